"""Plain decoding vs Medusa, measured side by side on the same model, prompts and settings.

    python inference/benchmark.py --threads 2 --max_new_tokens 64,256 --runs 3 --out bench.json

By default Medusa runs in the dtype, tree and graph mode chosen for this machine (--dtype auto,
--medusa_choices auto, --compile auto) and plain decoding in every dtype of the device whose model copy fits,
eager and captured, all interleaved, and the speed-up is over the plain decoding that was fastest in this run;
--dtype X runs both in X, --baseline_dtype X the plain side in X, --compile off keeps both eager. Time spent
compiling (first calls of new shapes) is reported separately and left out of every rate. Both use the same model weights, device, threads, max_new_tokens and stopping
rule (EOS for both, or --ignore_eos for both), the same KV cache and the same forward; both are warmed
up, timed with device synchronisation, repeated --runs times (interleaved) and reported as medians.
Tokens are counted from ids, each side's own. Greedy outputs are compared token for token (identical
in fp32 when both sides run in the same dtype).

Metrics: tokens/s of each side from its own tokens and time, speed-up = ratio of those rates; tau = tokens per Medusa verification step (prefill excluded);
ms per Medusa step and ms per plain token (decode phase only); overhead = step time / token time; step_sizes =
how many Medusa steps verified each number of tokens (1: a plain step the schedule chose), switches = how often
it changed its choice. --profile_phases splits each side's ms per step into its phases.
"""

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from inference.engine.decoding import DecodeRequest, DecodeStats, eos_ids
from inference.engine.phases import CAPTURED, PHASES, PhaseClock
from inference.engine.plain_decoding import PlainDecoder
from inference.runtime.arguments import ArgumentParser, add_model_args, positive_int
from inference.runtime.calibration import CANDIDATE_DTYPES, copy_fits, hardware_description, model_in_dtype
from inference.runtime.chat import prompt_ids, read_prompts
from inference.runtime.console import to_stderr
from inference.runtime.devices import dtype_name, parse_dtype, resolve_device, set_threads, synchronize
from inference.runtime.errors import UserError, run_command
from inference.runtime.outputs import check_output_file, replace_atomic, write_atomic
from medusa_model import MedusaModel

BUILTIN_PROMPTS = Path(__file__).with_name("benchmark_prompts.jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--medusa_dir", help="heads directory (default: the demo heads, else untrained heads)")
    parser.add_argument("--medusa_choices", default="auto",
                        help="auto (chosen for this machine), heads (saved with the heads), a tree name or JSON file, "
                        "or dynamic[:N][:lookup=K][:levels=L] (N nodes chosen at every step from the heads' probabilities, "
                        "drafted L levels deep at most, and up to K context-lookup tokens; lookup=0: the heads alone)")
    parser.add_argument("--prompts", help="jsonl with 'prompt', MT-Bench 'turns' (first turn) or ShareGPT "
                        "'conversations'; optional 'category' (default: the built-in mixed set)")
    parser.add_argument("--num_prompts", type=positive_int, help="use the first N prompts")
    parser.add_argument("--max_new_tokens", default="128", help="one length or a comma-separated sweep, e.g. 64,256,1024")
    parser.add_argument("--runs", type=positive_int, default=3, help="timed repetitions per prompt (medians reported)")
    parser.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens (both decoders)")
    parser.add_argument("--baseline_dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                        help="plain decoding's dtype: auto (every dtype of the device that fits, the fastest in this run "
                        "counts; --dtype's where that is given, which sets both sides) or bf16 | fp16 | fp32")
    parser.add_argument("--schedule", choices=("adaptive", "fixed", "both"), default="adaptive",
                        help="adaptive (default): each Medusa step runs the tree size, or plain step, that real steps "
                        "show fastest; fixed: the runtime's first choice at every step; both: the two interleaved per "
                        "prompt in this run, each reported (the table's Medusa columns are the adaptive one)")
    parser.add_argument("--profile_phases", action="store_true",
                        help="also time each side's step phases (drafting, forward, acceptance and KV keep, host; a "
                        "captured step is one phase) and print ms per step of each beside the measured ms per step. "
                        "On an accelerator each phase ends with a device synchronisation, so that run's rates run slow")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="write a PNG of speed-up and tau against length (default: next to --out)")
    return parser.parse_args(argv)


def load_benchmark_prompts(path: str | None, limit: int | None) -> list[dict]:
    """[{prompt, category}]; ShareGPT files use their first human turn, MT-Bench files their first turn."""
    if path and Path(path).is_file() and Path(path).read_text(encoding="utf-8").lstrip().startswith("["):
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        items = [
            {"prompt": turn["value"], "category": "sharegpt"}
            for record in data
            for turn in record.get("conversations", [])[:1]
            if turn.get("from") == "human" and turn.get("value", "").strip()
        ]
    else:
        items = [{"prompt": item["turns"][0], "category": item.get("category", "all")}
                 for item in read_prompts(path or str(BUILTIN_PROMPTS))]
    if limit:
        items = items[:limit]
    if not items:
        raise UserError("no prompts to benchmark")
    return items


def timed(decode, device, profile: bool = False) -> tuple[list[int], DecodeStats, float, float]:
    """(ids, stats, total seconds, decode-phase seconds after the first token), device-synchronised, both
    without the seconds spent compiling in them; `profile`: the stats time the step phases too."""
    stats = DecodeStats(phases=PhaseClock(device) if profile else None)
    ids: list[int] = []
    synchronize(device)
    start = time.perf_counter()
    first = None
    for step in decode(stats):
        ids.extend(step)
        if first is None:
            synchronize(device)
            first, compiled_before_first = time.perf_counter(), stats.compile_seconds
    synchronize(device)
    end = time.perf_counter()
    return ids, stats, end - start - stats.compile_seconds, end - first - (stats.compile_seconds - compiled_before_first)


def medusa_fields(samples: list[tuple]) -> dict:
    """A row's Medusa figures from its timed runs [(seconds, decode seconds, ids, stats)]: median times, the
    first run's counts."""
    ids, stats = samples[0][2], samples[0][3]
    return {
        "tokens": len(ids),
        "medusa_seconds": statistics.median(s[0] for s in samples),
        "medusa_decode_seconds": statistics.median(s[1] for s in samples),
        "medusa_steps": stats.steps,
        "medusa_step_sizes": {str(k): v for k, v in sorted(stats.step_sizes.items())},
        "medusa_switches": stats.switches,
    }


def phase_split(samples: list[tuple]) -> dict:
    """Per side, over the rows' first runs [(decode seconds, stats)]: ms per step of each phase beside the
    measured ms per step (the two differ by what no phase covers: the first token's emit, the clock itself)."""
    steps = sum(stats.steps for _, stats in samples)
    seconds = Counter()
    for _, stats in samples:
        seconds.update(stats.phases.seconds)
        seconds[CAPTURED] -= stats.compile_seconds  # a recompile inside a timed run is not a step's cost
    return {
        "steps": steps,
        "ms_per_step": round(1000 * sum(decode for decode, _ in samples) / max(steps, 1), 3),
        "phases": {phase: round(1000 * seconds[phase] / max(steps, 1), 3) for phase in PHASES if seconds[phase] > 0},
    }


def summarise(rows: list[dict]) -> dict:
    """Aggregate per-prompt medians: totals over prompts, so long answers weigh as they cost. Each side's
    rate is its own tokens over its own time."""
    tokens, base_tokens = sum(r["tokens"] for r in rows), sum(r["baseline_tokens"] for r in rows)
    base_rate = base_tokens / sum(r["baseline_seconds"] for r in rows)
    med_rate = tokens / sum(r["medusa_seconds"] for r in rows)
    steps = sum(r["medusa_steps"] for r in rows)
    ms_step = 1000 * sum(r["medusa_decode_seconds"] for r in rows) / max(steps, 1)
    ms_token = 1000 * sum(r["baseline_decode_seconds"] for r in rows) / max(base_tokens - len(rows), 1)
    return {
        "prompts": len(rows),
        "new_tokens": tokens,
        "baseline_new_tokens": base_tokens,
        "baseline_tokens_per_second": round(base_rate, 3),
        "medusa_tokens_per_second": round(med_rate, 3),
        "speedup": round(med_rate / base_rate, 4),
        "tokens_per_step": round((tokens - len(rows)) / max(steps, 1), 4),
        "ms_per_medusa_step": round(ms_step, 3),
        "ms_per_plain_token": round(ms_token, 3),
        "overhead": round(ms_step / ms_token, 4),
        "outputs_identical": round(sum(r["identical"] for r in rows) / len(rows), 4),
        "step_sizes": step_sizes(rows),
        "switches": sum(r["medusa_switches"] for r in rows),
    }


def schedule_rows(rows: list[dict], schedule: str) -> list[dict]:
    """The rows as if `schedule`'s Medusa runs were the only ones (`--schedule both` times each)."""
    return [{**row, **row["schedules"][schedule]} for row in rows]


def step_sizes(rows: list[dict]) -> dict[str, int]:
    """How many Medusa steps verified each number of tokens (1: a plain step), over the rows' first runs."""
    total = Counter()
    for row in rows:
        total.update({int(k): v for k, v in row["medusa_step_sizes"].items()})
    return {str(k): v for k, v in sorted(total.items())}


def print_table(results: dict, file=None) -> None:
    file = file or sys.stdout
    config = results["config"]
    medusa = (f"Medusa {config['medusa_dtype']}, {config['tree_tokens']}-token tree" if config["tree_tokens"] > 1
              else f"Medusa's fallback, plain {config['medusa_dtype']}") + f" ({config['graph_mode']})"
    print(f"{config['hardware']} | plain {config['baseline_dtype']} vs {medusa}", file=file)
    header = f"{'max_new':>8} {'prompts':>7} {'tokens':>7} {'plain tok/s':>11} {'medusa tok/s':>12} {'speedup':>8} " \
             f"{'tau':>6} {'ms/step':>8} {'ms/token':>8} {'overhead':>8} {'identical':>9}"
    print(header, file=file)

    def line(label, r):
        print(f"{label:>8} {r['prompts']:>7} {r['new_tokens']:>7} {r['baseline_tokens_per_second']:>11.2f} "
              f"{r['medusa_tokens_per_second']:>12.2f} {r['speedup']:>7.3f}x {r['tokens_per_step']:>6.3f} "
              f"{r['ms_per_medusa_step']:>8.2f} {r['ms_per_plain_token']:>8.2f} {r['overhead']:>8.3f} "
              f"{r['outputs_identical']:>9.2f}", file=file)

    for r in results["by_length"]:
        line(str(r["max_new_tokens"]), r)
    line("all", results)
    if len(config["plain_tokens_per_second"]) > 1:
        rates = ", ".join(f"{name} {rate:.2f}" for name, rate in config["plain_tokens_per_second"].items())
        print(f"plain tok/s: {rates} (the fastest is the baseline)", file=file)
    compiling = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in config["compile_seconds"].items() if seconds)
    if compiling:
        print(f"compiling (left out of the rates): {compiling}", file=file)
    for r in results.get("by_schedule", []):
        print(f"schedule {r['schedule']:>8}: medusa {r['medusa_tokens_per_second']:.2f} tok/s, {r['speedup']:.3f}x, "
              f"tau {r['tokens_per_step']:.3f}, step sizes {r['step_sizes']}, identical {r['outputs_identical']:.2f}",
              file=file)
    for side, split in results.get("phases", {}).items():
        phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in split["phases"].items())
        print(f"phases {side}: {phases} ms/step (measured {split['ms_per_step']:.2f} ms/step)", file=file)
    if len(results["by_category"]) > 1:
        print(f"\n{'category':>14} {'prompts':>7} {'speedup':>8} {'tau':>6}", file=file)
        for r in results["by_category"]:
            print(f"{r['category']:>14} {r['prompts']:>7} {r['speedup']:>7.3f}x {r['tokens_per_step']:>6.3f}", file=file)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["max_new_tokens"] for r in results["by_length"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lengths, [r["speedup"] for r in results["by_length"]], "o-", label="speed-up (x)")
    ax.plot(lengths, [r["tokens_per_step"] for r in results["by_length"]], "s-", label="tokens per step (tau)")
    ax.plot(lengths, [r["overhead"] for r in results["by_length"]], "^--", label="step overhead (x)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_new_tokens")
    ax.set_title(f"Medusa vs plain decoding: {results['config']['model']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    replace_atomic(path, lambda staging: fig.savefig(staging, dpi=120, format="png"))
    plt.close(fig)


def baseline_dtypes(args: argparse.Namespace, runtime, model) -> list[torch.dtype]:
    """The dtypes plain decoding is timed in: the one asked for (--baseline_dtype, or --dtype for both sides),
    else every candidate dtype of the device whose copy of the model fits, so that the speed-up is over the
    plain decoding measured fastest in this run, not over the calibration's pick (on a 2-core Xeon it timed
    plain bf16 at 57.8 ms and fp32 at 59.2, and the benchmark then measured fp32 at 47 ms and bf16 at 57)."""
    if args.baseline_dtype != "auto":
        return [parse_dtype(args.baseline_dtype)]
    if args.dtype != "auto":
        return [runtime.plain_dtype]
    candidates = [dtype for dtype in CANDIDATE_DTYPES[model.device.type] if copy_fits(model, dtype)]
    return sorted(set(candidates) | {runtime.plain_dtype}, key=dtype_name)


def plain_rates(rows: list[dict]) -> dict[str, float]:
    """Tokens per second of plain decoding in each timed dtype over all rows (its own tokens over its own time)."""
    return {name: sum(r["plain"][name]["tokens"] for r in rows) / sum(r["plain"][name]["seconds"] for r in rows)
            for name in rows[0]["plain"]}


def fastest_baseline(rates: dict[str, float]) -> str:
    """The plain dtype with the highest rate (`plain_rates`, over all rows together)."""
    return max(rates, key=rates.get)


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    try:
        lengths = sorted({int(x) for x in str(args.max_new_tokens).split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise UserError(f"--max_new_tokens {args.max_new_tokens}: give positive lengths, e.g. 128 or 64,256")
    set_threads(args.threads)
    medusa = MedusaModel.from_pretrained(args.base_model, args.medusa_dir, resolve_device(args.device),
                                         parse_dtype(args.dtype), args.medusa_choices, args.compile)
    runtime, tokenizer = medusa.runtime, medusa.tokenizer
    schedules = ("adaptive", "fixed") if args.schedule == "both" else (args.schedule,)
    if len(schedules) > 1 and medusa.schedule is None:
        raise UserError("--schedule both: this Medusa run has no per-step choice to compare (a tree was given or "
                        "plain decoding was chosen); use --medusa_choices auto")
    model = medusa.base_model
    device = model.device
    # Plain decoding in each of its dtypes (a copy where that differs from Medusa's), eager and captured; the
    # fastest is the baseline, reported by name.
    plain_models = {}
    for dtype in baseline_dtypes(args, runtime, model):
        copy_ = model_in_dtype(model, dtype)
        plain_models[dtype_name(dtype)] = PlainDecoder(copy_)
        if args.compile != "off":
            plain_models[f"{dtype_name(dtype)} captured"] = PlainDecoder(copy_, compile=True, log=to_stderr)
    print(f"Medusa: {runtime.reason} ({runtime.graph_mode}); baseline: plain decoding in {' or '.join(plain_models)}, "
          "whichever is faster in this run", file=sys.stderr)
    prompts = load_benchmark_prompts(args.prompts, args.num_prompts)
    eos = () if args.ignore_eos else eos_ids(model.generation_config.eos_token_id, tokenizer.eos_token_id)
    ids = [prompt_ids(tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in prompts]

    def plain(name, request):
        return lambda stats: plain_models[name].decode(request, stats)

    def spec(request, schedule):
        return lambda stats: medusa.decode(request, stats=stats, scheduled=schedule == "adaptive")

    def medusa_side(schedule):
        return "medusa" if schedule == schedules[0] else f"medusa {schedule}"

    compile_seconds = defaultdict(float)
    warm = DecodeRequest(ids[0], 16, eos)
    warm_ups = [(name, plain(name, warm)) for name in plain_models] + [(medusa_side(s), spec(warm, s)) for s in schedules]
    for name, decode in warm_ups:
        compile_seconds[name] += timed(decode, device)[1].compile_seconds
    rows = []
    first_runs = defaultdict(list)  # side -> [(decode seconds, stats)] of each row's first run
    sides = len(plain_models) + len(schedules)
    progress = tqdm(total=len(lengths) * len(prompts) * args.runs * sides, desc="benchmark", unit="run", file=sys.stderr)
    for length in lengths:
        for prompt, prompt_ids_ in zip(prompts, ids):
            request = DecodeRequest(prompt_ids_, length, eos)
            samples = defaultdict(list)
            order = [(medusa_side(s), spec(request, s)) for s in schedules] + \
                [(name, plain(name, request)) for name in plain_models]
            for run_index in range(args.runs):
                for name, decode in order if run_index % 2 == 0 else order[::-1]:
                    out, stats, total, decode_s = timed(decode, device, args.profile_phases)
                    compile_seconds[name] += stats.compile_seconds
                    samples[name].append((total, decode_s, out, stats))
                    progress.update()
            med_out = samples["medusa"][0][2]
            row = {
                "max_new_tokens": length,
                "category": prompt["category"],
                **medusa_fields(samples["medusa"]),
                "plain": {name: {"tokens": len(samples[name][0][2]),
                                 "identical": samples[name][0][2] == med_out,
                                 "seconds": statistics.median(s[0] for s in samples[name]),
                                 "decode_seconds": statistics.median(s[1] for s in samples[name])}
                          for name in plain_models},
            }
            if len(schedules) > 1:
                row["schedules"] = {s: {**medusa_fields(samples[medusa_side(s)]),
                                        "same_as_plain": {name: samples[name][0][2] == samples[medusa_side(s)][0][2]
                                                          for name in plain_models}}
                                    for s in schedules}
            rows.append(row)
            for name, runs in samples.items():
                first_runs[name].append((runs[0][1], runs[0][3]))
    rates = plain_rates(rows)
    baseline_dtype = fastest_baseline(rates)
    for row in rows:
        base = row["plain"][baseline_dtype]
        row.update(baseline_tokens=base["tokens"], identical=base["identical"], baseline_seconds=base["seconds"],
                   baseline_decode_seconds=base["decode_seconds"])
        for entry in row.get("schedules", {}).values():
            entry["identical"] = entry["same_as_plain"][baseline_dtype]
    progress.close()
    results = summarise(rows)
    results["by_length"] = [{"max_new_tokens": n, **summarise([r for r in rows if r["max_new_tokens"] == n])}
                            for n in lengths]
    categories = sorted({r["category"] for r in rows})
    results["by_category"] = [{"category": c, **summarise([r for r in rows if r["category"] == c])} for c in categories]
    if len(schedules) > 1:
        results["by_schedule"] = [{"schedule": s, **summarise(schedule_rows(rows, s))} for s in schedules]
    if args.profile_phases:
        results["phases"] = {name: phase_split(first_runs[name]) for name in [*map(medusa_side, schedules), *plain_models]}
    results["config"] = {
        "command": " ".join(sys.argv),
        "model": getattr(model.config, "name_or_path", "") or str(args.base_model or "demo"),
        "device": str(device), "hardware": hardware_description(device), "threads": torch.get_num_threads(),
        "baseline_dtype": baseline_dtype, "medusa_dtype": dtype_name(runtime.dtype), "tree_tokens": runtime.tree_tokens,
        "graph_mode": runtime.graph_mode,
        "compile_seconds": {name: round(compile_seconds[name], 1) for name in [*map(medusa_side, schedules), *plain_models]},
        "plain_tokens_per_second": {name: round(rate, 3) for name, rate in rates.items()},
        "choice": runtime.reason, "heads": medusa.medusa_head.num_heads, "schedule": args.schedule,
        "step_options": [o.tokens for o in runtime.options] if "adaptive" in schedules else [],
        "runs": args.runs, "ignore_eos": args.ignore_eos, "prompts": len(prompts),
    }
    results["rows"] = rows
    return results


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        plot_path = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
        for flag, path in (("--out", args.out), ("--plot", plot_path)):
            if path:
                check_output_file(path, flag)
        results = run(args)
        print_table(results)
        if args.out:
            write_atomic(args.out, json.dumps(results, indent=2) + "\n")
        if plot_path:
            plot(results, plot_path)

    return run_command(body, "interrupted: no results written")


if __name__ == "__main__":
    sys.exit(main())
