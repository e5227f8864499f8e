"""What a decoding step costs on this machine: a plain token and Medusa tree steps of each size, per dtype.

Speculation pays only where verifying T tokens at once costs much less than T plain steps, and that is
a property of the hardware: on a CPU with native bf16 a 13-token forward costs ~1.3x one token, on an
AVX2-only CPU ~5x in bf16 but ~1.3x in fp32, on a GPU or NPU about 1x up to 64 tokens. So the costs are
measured, once per (machine, torch, threads, base model, heads, dtypes), and cached as JSON under
`$OPENPANGU_MEDUSA_HOME/calibration/`. A profile is plain data (`StepProfile`), so the choice it drives
(`inference.runtime.runtime_choice`) can be tested with any machine's numbers.

A profile is kept only when it can be trusted: its rounds agree, its costs are plausible, and no other process
took a share of the CPU while it was measured (bursty load, a compiler starting and stopping, misleads the
interleaving that steady load does not). Otherwise it serves this run only and the next run measures again.
"""

import contextlib
import copy
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from inference.engine.cpu_linear import native_bf16_cpu, packing_supported
from inference.engine.decoding import DecodeRequest
from inference.engine.host_memory import free_host_memory
from inference.engine.medusa_decoding import MedusaDecoder
from inference.engine.plain_decoding import PlainDecoder
from inference.runtime.console import to_stderr
from inference.runtime.devices import DTYPES, dtype_name, synchronize
from inference.runtime.errors import UserError
from inference.runtime.home import cache_home
from inference.runtime.outputs import check_writable, exclusive, write_atomic
from medusa_choices import DynamicTree, Tree, mc_sim_7b_63

# Tokens per Medusa step (root included) that are timed; other sizes are interpolated.
CPU_STEP_SIZES = (2, 3, 4, 5, 7, 9, 13, 17, 25, 33)
ACCELERATOR_STEP_SIZES = CPU_STEP_SIZES + (49, 64)
CANDIDATE_DTYPES = {"cpu": (torch.bfloat16, torch.float32), "cuda": (torch.bfloat16, torch.float16),
                    "npu": (torch.bfloat16, torch.float16)}
CONTEXT = 256  # cached tokens while timing
ROUNDS = 5
GRAPH_CONTEXT = 64  # cached tokens while timing eager against captured steps
SIZE_STEPS = 3  # captured steps per round when tree sizes are timed against each other (a few % apart)
ENGINE = 7  # raised when the engine's step changes what it costs, so older profiles are measured again
SPREAD = 0.4  # the most the rounds of one timing may disagree (interquartile range / median) in a kept profile:
# a quiet 2-core EPYC showed up to 0.32 over five rounds of one step each; one burst in five rounds moves no
# median and is let through, bursts in two show as 1.5 or more
CHEAPER = 0.6  # a step timed below this fraction of a smaller one's cost (or of the plain step's) is noise: a
# quiet EPYC times fp32 4-token steps at 0.72-0.77 of 3-token ones in every round (a kernel choice, not noise)
CORRECTED = 1.5  # a profile off real steps by more than this says so when it is corrected
BUSY = 0.2  # other processes' share of the machine's CPU time while calibrating above which it was busy
clock = time.perf_counter  # the timer of every timed step (replaced by the tests)


@dataclass
class StepProfile:
    """Measured ms of a plain token and of Medusa steps of `tokens` tokens, per dtype (named bf16, fp32... in
    its JSON)."""

    plain_ms: dict[torch.dtype, float]
    step_ms: dict[torch.dtype, dict[int, float]]
    hardware: str = ""
    realised: dict[torch.dtype, list[int]] = field(default_factory=dict)  # sizes (1: plain) timed in real steps
    path: Path | None = None  # where it is kept (None: it serves this run only)

    def tree_step_ms(self, dtype: torch.dtype, tokens: int) -> float:
        """ms of a `tokens`-token Medusa step: measured, or linear between (beyond) the nearest sizes."""
        points = sorted(self.step_ms[dtype].items())
        if len(points) == 1 or tokens <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if tokens <= x1:
                break
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def cost_ms(self, dtype: torch.dtype, tokens: int) -> float:
        """ms of a step of `tokens` tokens, 1 being the plain step."""
        return self.plain_ms[dtype] if tokens == 1 else self.tree_step_ms(dtype, tokens)

    def to_dict(self) -> dict:
        return {"plain_ms": {dtype_name(d): ms for d, ms in self.plain_ms.items()},
                "step_ms": {dtype_name(d): table for d, table in self.step_ms.items()}, "hardware": self.hardware,
                "realised": {dtype_name(d): sizes for d, sizes in self.realised.items()}}

    def corrected(self, dtype: torch.dtype, costs: dict[int, float]) -> "StepProfile":
        """This profile with `dtype`'s costs as real steps timed them (`costs`: tokens per step -> ms, 1 for
        plain); a size not timed moves with the nearest timed one."""
        timed = {tokens: ms for tokens, ms in costs.items() if tokens > 1}
        table = dict(self.step_ms[dtype])
        for tokens, ms in table.items():
            nearest = min(timed, key=lambda t: abs(t - tokens)) if timed else None
            table[tokens] = round(timed.get(tokens, ms * timed[nearest] / self.tree_step_ms(dtype, nearest))
                                  if nearest else ms, 3)
        return replace(self, plain_ms=self.plain_ms | ({dtype: round(costs[1], 3)} if 1 in costs else {}),
                       step_ms=self.step_ms | {dtype: table},
                       realised=self.realised | {dtype: sorted(set(self.realised.get(dtype, [])) | set(costs))})

    @classmethod
    def from_dict(cls, data: dict, dtypes: list[torch.dtype] | None = None,
                  sizes: tuple[int, ...] | None = None) -> "StepProfile":
        """The profile in `data`, checked: timings for the same dtypes (`dtypes`, where given) and step sizes
        (`sizes`, where given) in each, every one a finite positive number of ms."""
        step_ms = {DTYPES[name]: {int(t): float(ms) for t, ms in table.items()} for name, table in data["step_ms"].items()}
        plain_ms = {DTYPES[name]: float(ms) for name, ms in data["plain_ms"].items()}
        if not plain_ms or set(step_ms) != set(plain_ms) or (dtypes is not None and set(plain_ms) != set(dtypes)):
            raise ValueError("a calibration profile needs plain and step timings for the same dtypes")
        if sizes is not None and any(set(table) != set(sizes) for table in step_ms.values()):
            raise ValueError(f"a calibration profile needs a timing for each step size {sizes}")
        if not all(math.isfinite(ms) and ms > 0 for ms in [*plain_ms.values()] + [ms for table in step_ms.values()
                                                                               for ms in table.values()]):
            raise ValueError("a calibration profile's timings must be finite positive numbers of ms")
        realised = {DTYPES[name]: [int(t) for t in sizes] for name, sizes in data.get("realised", {}).items()}
        return cls(plain_ms, step_ms, str(data.get("hardware", "")), realised)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_description(device: torch.device) -> str:
    """The device as a person would name it, with what decides its speed: 'AMD EPYC (AVX512, native bf16),
    torch 2.13.0, 2 threads'."""
    if device.type == "cpu":
        bf16 = "native bf16" if native_bf16_cpu() else "no native bf16"
        name = f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}, {bf16})"
    elif device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = torch.npu.get_device_name(device)
    return f"{name}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def calibration_tree(tokens: int, heads) -> Tree | DynamicTree:
    """The kind of tree `auto` decodes with at this size, `tokens - 1` nodes: a dynamic tree for heads that
    propose after verification (it drafts one level per head, so it costs more than a fixed tree of the same
    size: 7-15% in fp32 on an AVX2 CPU for the demo heads), else a prefix-closed fixed tree no deeper than
    the heads (heads that run in the verification pass cost the same whatever the tree's shape)."""
    dynamic = DynamicTree(tokens - 1)
    if heads.propose_after_verification and dynamic.fits(heads.num_heads):
        return dynamic
    if heads.config.medusa_head_input == "features":  # it drafts dynamic trees only: one level wide enough
        return DynamicTree(tokens - 1, top_k=tokens - 1, expand=min(DynamicTree.expand, tokens - 1))
    nodes = [path for path in mc_sim_7b_63 if len(path) <= heads.num_heads]
    if tokens - 1 > len(nodes):
        nodes += [[rank] for rank in range(10, 10 + tokens - 1 - len(nodes))]
    return nodes[: tokens - 1]


def step_runner(model, calls: int, tree: Tree | DynamicTree | None = None, heads=None,
                context: int = CONTEXT, captured: bool = False) -> Callable[[], None]:
    """Each call runs one real decoding step after `context` random tokens: a plain step, or with `tree` a
    whole Medusa step (verification forward, acceptance, KV keep, next proposals, the one transfer), eager or
    `captured`. The step's shapes do not depend on what is accepted, so random heads and tokens cost what
    real ones do. A captured step compiles at its first call (the untimed warm-up round)."""
    if tree is None:
        depth = 0
    else:
        depth = tree.depth(heads.num_heads) if isinstance(tree, DynamicTree) else max(map(len, tree))
    max_new_tokens = (calls + 1) * (depth + 1)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit:
        context = max(1, min(context, limit - max_new_tokens - len(tree or ()) - 1))
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=generator).tolist()
    request = DecodeRequest(prompt, max_new_tokens)
    if tree is None:
        steps = PlainDecoder(model, captured).decode(request)
    else:
        steps = MedusaDecoder(model, heads, captured).decode(request, tree)
    next(steps)  # the prefill

    def run() -> None:
        next(steps)

    return run


def interleaved_rounds(runners: dict, repeats: int, device, progress=None,
                       load: "LoadMeter | None" = None) -> dict[object, list[float]]:
    """ms of each runner in each of `repeats` rounds that run every runner once, in turn, after one warm-up
    round (where captured steps compile): drift of a shared machine (clock, a neighbour's load) then hits every
    size alike. `load` meters the other processes' share of the CPU over the timed rounds."""
    times = {key: [] for key in runners}
    for run in runners.values():
        run()
    synchronize(device)
    if progress is not None:
        progress.update()
    with load or contextlib.nullcontext():
        for _ in range(repeats):
            for key, run in runners.items():
                synchronize(device)
                start = clock()
                run()
                synchronize(device)
                times[key].append(1000 * (clock() - start))
            if progress is not None:
                progress.update()
    return times


def medians(times: dict[object, list[float]]) -> dict:
    """The median of each runner's rounds."""
    return {key: statistics.median(values) for key, values in times.items()}


def interleaved_ms(runners: dict, repeats: int, device, progress=None, load: "LoadMeter | None" = None) -> dict:
    """Median ms of each runner over `interleaved_rounds`."""
    return medians(interleaved_rounds(runners, repeats, device, progress, load))


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process) so far; None where the
    kernel does not say (not Linux)."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own.user + own.system


class LoadMeter:
    """Other processes' share of the machine's CPU time while the `with` block ran: the machine's busy time
    (a virtual machine's stolen time included) less this process's own, over the block's seconds x CPUs."""

    def __init__(self, read: Callable[[], tuple[float, float] | None] = _cpu_seconds,
                 elapsed: Callable[[], float] = time.monotonic, cpus: int | None = None):
        self.read, self.elapsed, self.cpus = read, elapsed, cpus or os.cpu_count() or 1
        self.share: float | None = None

    def __enter__(self) -> "LoadMeter":
        self._start, self._started = self.read(), self.elapsed()
        return self

    def __exit__(self, *exc) -> None:
        end, seconds = self.read(), self.elapsed() - self._started
        if self._start is None or end is None or seconds <= 0:
            return
        others = (end[0] - self._start[0]) - (end[1] - self._start[1])
        self.share = max(0.0, others / (seconds * self.cpus))


def busy(others_share: float | None) -> list[str]:
    """Other processes' share of the CPU time beyond BUSY while timing ran, as a reason not to keep the timing (none:
    quiet, or not known)."""
    if others_share is not None and others_share > BUSY:
        return [f"other processes took {others_share:.0%} of the CPU time while it ran"]
    return []


def doubts(rounds: dict[tuple[torch.dtype, int], list[float]], profile: "StepProfile",
           others_share: float | None) -> list[str]:
    """Why a measured profile should not be kept (none: keep it): rounds that disagree beyond SPREAD, costs
    no hardware has (a larger step much cheaper than a smaller one, plain slower than the smallest tree step),
    or other processes busy on the machine beyond BUSY while it was measured."""
    found = busy(others_share)
    for (dtype, tokens), values in rounds.items():
        if len(values) >= 3:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
            spread = (q3 - q1) / statistics.median(values)
            if spread > SPREAD:
                what = "plain step" if tokens == 1 else f"{tokens}-token step"
                found.append(f"the {dtype_name(dtype)} {what}'s rounds disagree by {spread:.0%}")
    for dtype, table in profile.step_ms.items():
        sizes = sorted(table)
        if sizes and profile.plain_ms[dtype] * CHEAPER > table[sizes[0]]:
            found.append(f"a {dtype_name(dtype)} plain step ({profile.plain_ms[dtype]:.1f} ms) timed slower than a "
                         f"{sizes[0]}-token step ({table[sizes[0]]:.1f} ms)")
        for index, larger in enumerate(sizes[1:], start=1):
            dearest = max(sizes[:index], key=table.get)
            if table[larger] < CHEAPER * table[dearest]:
                found.append(f"a {dtype_name(dtype)} {larger}-token step ({table[larger]:.1f} ms) timed far below a "
                             f"{dearest}-token one ({table[dearest]:.1f} ms)")
                break
    return found


def model_in_dtype(model, dtype: torch.dtype):
    """The model itself, or a copy in `dtype` (the original stays as loaded)."""
    return model if model.dtype == dtype else copy.deepcopy(model).to(dtype)


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` (host memory for the CPU)."""
    if device.type == "cpu":
        return free_host_memory()
    return (torch.cuda if device.type == "cuda" else torch.npu).mem_get_info(device)[0]


def copy_fits(model, dtype: torch.dtype) -> bool:
    """Whether a copy of the model in `dtype` fits beside it, with a fifth to spare for the timed steps
    (a 7B model's fp32 copy does not fit on most CPUs that hold its bf16 weights)."""
    if model.dtype == dtype:
        return True
    needed = sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8
    return needed * 1.2 < free_memory(model.device)


def measure(model, heads, dtypes: list[torch.dtype], sizes: tuple[int, ...], rounds: int = ROUNDS,
            progress=None) -> tuple[StepProfile, list[str]]:
    """Time the plain token and every step size in every dtype, all interleaved round after round; returns
    the profile and the `doubts` that keep it from being cached."""
    runners = {}
    for dtype in dtypes:
        model_d = model_in_dtype(model, dtype)
        runners[(dtype, 1)] = step_runner(model_d, rounds + 1)
        heads_d = copy.deepcopy(heads).to(dtype=dtype) if sizes else None
        for tokens in sizes:
            runners[(dtype, tokens)] = step_runner(model_d, rounds + 1, calibration_tree(tokens, heads), heads_d)
    load = LoadMeter()
    times = interleaved_rounds(runners, rounds, model.device, progress, load)
    ms = medians(times)
    profile = StepProfile(
        plain_ms={dtype: round(ms[(dtype, 1)], 3) for dtype in dtypes},
        step_ms={dtype: {tokens: round(ms[(dtype, tokens)], 3) for tokens in sizes} for dtype in dtypes},
        hardware=hardware_description(model.device),
    )
    return profile, doubts(times, profile, load.share if model.device.type == "cpu" else None)


def profile_key(model, heads, dtypes: list[torch.dtype], sizes: tuple[int, ...]) -> dict:
    """What the costs depend on: a different machine, torch, thread count, model, heads or dtype re-measures."""
    c = model.config
    h = heads.config if heads is not None else None
    return {
        "hardware": hardware_description(model.device),
        "device": model.device.type,
        "model": [getattr(c, "_name_or_path", ""), c.model_type, c.hidden_size, c.num_hidden_layers,
                  c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size],
        "heads": None if h is None else [h.medusa_num_heads, h.medusa_num_layers, h.medusa_head_layout,
                                         h.medusa_head_input, h.medusa_draft_vocab_size],
        "trees": "dynamic" if heads is not None and heads.propose_after_verification else "fixed",
        "cpu_bf16_linears": "packed" if model.device.type == "cpu" and packing_supported() else "aten",
        "dtypes": [dtype_name(d) for d in dtypes],
        "sizes": list(sizes),
        "context": CONTEXT,
        "rounds": ROUNDS,
        "engine": ENGINE,
    }


def calibration_dir() -> Path:
    return cache_home() / "calibration"


def profile_path(key: dict) -> Path:
    """Where the profile measured for `key` is cached: one file per distinct key."""
    return calibration_dir() / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"


def step_profile(model, heads, dtypes: list[torch.dtype] | None = None, log=None) -> StepProfile:
    """The cached profile of this machine and model, measuring it first if there is none (or it is unreadable).

    `heads` None: plain steps only. `dtypes`: the dtypes to consider (default: the device's candidates).
    `log`: where the one-line notices go (default stderr).
    """
    log = log or to_stderr
    device_type = model.device.type
    dtypes = list(dtypes or CANDIDATE_DTYPES[device_type])
    skipped = [dtype for dtype in dtypes if not copy_fits(model, dtype)]
    if skipped:
        log(f"not timing {', '.join(map(dtype_name, skipped))}: a copy of the model in it does not fit in the "
            "free memory")
        dtypes = [dtype for dtype in dtypes if dtype not in skipped]
    sizes = () if heads is None else CPU_STEP_SIZES if device_type == "cpu" else ACCELERATOR_STEP_SIZES
    key = profile_key(model, heads, dtypes, sizes)
    path = profile_path(key)
    profile = read_profile(path, dtypes, sizes, log)
    if profile is not None:
        return replace(profile, path=path)
    steps = f"the plain step and {len(sizes)} tree step sizes" if sizes else "the plain step"
    what = f"step costs for this machine and model ({', '.join(map(dtype_name, dtypes))}; {steps})"
    try:
        check_writable(path.parent, "the calibration cache")
    except UserError as error:
        log(f"Calibrating {what} for this run only: {error} (set OPENPANGU_MEDUSA_HOME to a writable directory to "
            "keep the result)")
        return _measure(model, heads, dtypes, sizes)[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(path, on_wait=lambda: log(f"Waiting for another process that is calibrating {path} ...")):
        profile = read_profile(path, dtypes, sizes, lambda line: None)  # the other process's result, if any
        if profile is None:
            log(f"Calibrating {what}; once: a result it can trust is kept in {path}")
            profile, found = _measure(model, heads, dtypes, sizes)
            if found:
                log(f"Not keeping this calibration, it serves this run only and the next run measures again: "
                    f"{'; '.join(found[:2])}{f' (and {len(found) - 2} more)' if len(found) > 2 else ''}")
            else:  # atomic: an interrupted calibration never leaves a half-written profile
                write_atomic(path, json.dumps({"key": key, "profile": profile.to_dict()}, indent=1) + "\n")
                profile = replace(profile, path=path)
        else:
            profile = replace(profile, path=path)
    return profile


def write_correction(profile: StepProfile, dtype: torch.dtype, costs: dict[int, float], log=None) -> StepProfile:
    """`profile` corrected by `dtype`'s costs as real steps timed them, also in its file (where it is kept), so
    the next process decides from them and skips timing them again."""
    corrected = profile.corrected(dtype, costs)
    if profile.path is None:
        return corrected
    log = log or to_stderr
    off = max(max(ms / profile.cost_ms(dtype, t), profile.cost_ms(dtype, t) / ms) for t, ms in costs.items())
    try:
        with exclusive(profile.path):
            key = json.loads(profile.path.read_text())["key"]
            write_atomic(profile.path, json.dumps({"key": key, "profile": corrected.to_dict()}, indent=1) + "\n")
    except (OSError, ValueError, KeyError) as error:
        log(f"not keeping the step costs timed in real steps: {error}")
        return corrected
    if off > CORRECTED:
        costs_text = ", ".join(f"{'plain' if t == 1 else f'{t}-token'} {ms:.1f} ms" for t, ms in sorted(costs.items()))
        log(f"The calibration was up to {off:.1f}x off what real steps cost ({costs_text}); corrected in {profile.path}")
    return corrected


def read_cached(path: Path, field: str, parse: Callable, log):
    """`parse` of `field` in the JSON cached at `path`; None where there is none, or it is unreadable (said, so
    it is measured again)."""
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text())[field])
    except (ValueError, KeyError, TypeError, AttributeError, OSError, UnicodeDecodeError) as error:
        log(f"calibration file {path} is unreadable ({error}): measuring again")
        return None


def read_profile(path: Path, dtypes: list[torch.dtype], sizes: tuple[int, ...], log) -> StepProfile | None:
    """The profile cached at `path` (`read_cached`)."""
    return read_cached(path, "profile", lambda data: StepProfile.from_dict(data, dtypes, sizes), log)


def _measure(model, heads, dtypes: list[torch.dtype], sizes: tuple[int, ...]) -> tuple[StepProfile, list[str]]:
    from tqdm import tqdm

    with tqdm(total=ROUNDS + 1, desc="calibrating", unit="round", file=sys.stderr) as progress:
        return measure(model, heads, dtypes, sizes, ROUNDS, progress)


@dataclass(frozen=True)
class GraphProfile:
    """ms of the plain step and of the chosen Medusa step, eager and captured, in each timed dtype (`step_ms` None:
    no Medusa step was timed), and of captured steps of other tree sizes (`sizes_ms`, by tokens per step, the
    chosen size's included) in the dtype whose captured step was fastest, where those were timed, with the
    fastest plain step of the same rounds as size 1."""

    plain_ms: dict[torch.dtype, dict[str, float]]  # dtype -> "eager" / "captured" -> ms
    step_ms: dict[torch.dtype, dict[str, float]] | None
    sizes_ms: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def fastest(table: dict[torch.dtype, dict[str, float]]) -> tuple[torch.dtype, bool, float]:
        """The dtype and graph mode (True: captured) of the cheapest step in `table`, and its ms."""
        dtype, mode = min(((d, mode) for d, modes in table.items() for mode in modes), key=lambda dm: table[dm[0]][dm[1]])
        return dtype, mode == "captured", table[dtype][mode]

    def captured_costs(self, dtype: torch.dtype, tokens: int) -> tuple[float, float]:
        """ms of a captured `tokens`-token step and of a captured plain step in `dtype`, both from the same rounds: the
        tree sizes' timing where it timed this size against a captured plain step in `dtype`, else the eager/captured
        timing."""
        plain_dtype, plain_captured, _ = self.fastest(self.plain_ms)
        if tokens in self.sizes_ms and 1 in self.sizes_ms and plain_dtype == dtype and plain_captured:
            return self.sizes_ms[tokens], self.sizes_ms[1]
        return self.step_ms[dtype]["captured"], self.plain_ms[dtype]["captured"]

    def captured_only(self) -> "GraphProfile":
        """The captured timings alone, what `--compile on` chooses among; a dtype keeps its eager timing only where
        its captured step failed on this machine (and then runs eager, as under `auto`)."""
        def captured(table: dict[torch.dtype, dict[str, float]] | None):
            return None if table is None else {
                dtype: {"captured": modes["captured"]} if math.isfinite(modes["captured"]) else modes
                for dtype, modes in table.items()}

        return replace(self, plain_ms=captured(self.plain_ms), step_ms=captured(self.step_ms))

    def to_dict(self) -> dict:
        return {side: None if table is None else {dtype_name(d): modes for d, modes in table.items()}
                for side, table in (("plain_ms", self.plain_ms), ("step_ms", self.step_ms))} | \
            {"sizes_ms": {str(tokens): ms for tokens, ms in self.sizes_ms.items()}}

    @classmethod
    def from_dict(cls, data: dict, dtypes: list[torch.dtype], with_step: bool) -> "GraphProfile":
        """The timings in `data`, checked: eager and captured in each of `dtypes`, for the Medusa step too where
        `with_step`."""
        def table(timed: dict) -> dict[torch.dtype, dict[str, float]]:
            if set(timed) != {dtype_name(d) for d in dtypes}:
                raise ValueError(f"eager and captured timings needed in {', '.join(map(dtype_name, dtypes))}")
            return {DTYPES[name]: _checked_pair(modes) for name, modes in timed.items()}

        sizes_ms = {int(tokens): float(ms) for tokens, ms in data.get("sizes_ms", {}).items()}
        if not all(math.isfinite(ms) and ms > 0 for ms in sizes_ms.values()):
            raise ValueError("step times must be positive numbers")
        return cls(table(data["plain_ms"]), table(data["step_ms"]) if with_step else None, sizes_ms)


def graph_profile(model, heads, tree: Tree | DynamicTree | None, dtypes: list[torch.dtype], log=None,
                  alternatives: tuple[Tree | DynamicTree, ...] = ()) -> GraphProfile:
    """Eager against captured steps in each of `dtypes` (copies of `model`), for plain decoding and, with `tree`,
    for Medusa with `heads`, and where the captured Medusa step is the fastest, captured steps of the trees
    `alternatives` against the captured `tree` in that dtype: measured once per machine, model, heads, trees and
    dtypes, then read from the cache (unless other processes were busy while it ran). Every dtype is timed captured,
    as the eager order need not hold there: on a 2-core AMD EPYC with AVX512-BF16 and no AMX, an eager plain fp32
    step cost twice a bf16 one, and a captured one 0.78x of a captured bf16 one."""
    log = log or to_stderr
    key = profile_key(model, heads, dtypes, ()) | {"graph": repr(tree)}
    if alternatives:
        key["alternatives"] = [repr(other) for other in alternatives]
    path = profile_path(key)
    cached = read_cached(path, "graph", lambda data: GraphProfile.from_dict(data, dtypes, tree is not None), log)
    if cached is not None:
        return cached
    steps = "the plain step" + (" and the Medusa step" if tree else "")
    minutes = 3 * len(dtypes) // 2 + 1  # a compile takes about 40 s on 2 CPU cores
    if tree and alternatives:
        steps += f", then {len(alternatives)} more tree sizes captured,"
        minutes += (2 * len(alternatives) + 2) // 3
    log(f"Timing eager against captured steps: compiling {steps} in {', '.join(map(dtype_name, dtypes))} once "
        f"(about {minutes} min on 2 CPU cores; kept in {path})")
    models = {dtype: model_in_dtype(model, dtype) for dtype in dtypes}
    step_heads = {dtype: copy.deepcopy(heads).to(device=model.device, dtype=dtype) for dtype in dtypes} if tree else {}

    def runners(modes: tuple[str, ...]) -> dict:
        # a short context, so the timed graphs have the shapes of short prompts (the run that follows reuses
        # the kernels inductor built for them)
        timed = {}
        for dtype, mode in ((dtype, mode) for dtype in dtypes for mode in modes):
            timed[("plain", dtype, mode)] = step_runner(models[dtype], ROUNDS + 1, context=GRAPH_CONTEXT,
                                                        captured=mode == "captured")
            if tree is not None:
                timed[("step", dtype, mode)] = step_runner(models[dtype], ROUNDS + 1, tree, step_heads[dtype],
                                                           GRAPH_CONTEXT, mode == "captured")
        return timed

    steps_load, sizes_load = LoadMeter(), LoadMeter()  # other processes' share of the CPU while each timing ran
    try:
        ms = interleaved_ms(runners(("eager", "captured")), ROUNDS, model.device, load=steps_load)
    except Exception as error:  # a compiled kernel that fails on this CPU: eager still runs, and is timed instead
        log(f"A captured step failed on this machine, so both sides run eager ({_last_line(error)})")
        ms = interleaved_ms(runners(("eager",)), ROUNDS, model.device)
        ms |= {(side, dtype, "captured"): math.inf for side, dtype, _ in list(ms)}

    def table(side: str) -> dict[torch.dtype, dict[str, float]]:
        return {dtype: {mode: round(ms[(side, dtype, mode)], 3) for mode in ("eager", "captured")} for dtype in dtypes}

    profile = GraphProfile(table("plain"), table("step") if tree is not None else None)
    if math.inf in ms.values():
        return profile  # not kept: the next run tries capturing again (a fixed torch or compiler may build it)
    if alternatives and tree is not None and GraphProfile.fastest(profile.step_ms)[1]:
        try:
            profile = replace(profile, sizes_ms=_captured_sizes(profile, models, step_heads, (tree, *alternatives),
                                                                model.device, sizes_load))
        except Exception as error:  # as above: the chosen tree is kept, and the next run tries the others again
            log(f"A captured step of another tree size failed on this machine, so the chosen tree is kept "
                f"({_last_line(error)})")
            return profile
    shares = [load.share for load in (steps_load, sizes_load) if load.share is not None]
    found = busy(max(shares, default=None)) if model.device.type == "cpu" else []
    if found:
        log(f"Not keeping the eager/captured timings, they serve this run only and the next run measures again: "
            f"{found[0]}")
        return profile
    try:
        check_writable(path.parent, "the calibration cache")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": key, "graph": profile.to_dict()}, indent=1) + "\n")
    except (UserError, OSError) as error:
        log(f"not keeping the eager/captured timings: {error}")
    return profile


def _captured_sizes(profile: GraphProfile, models: dict, step_heads: dict, trees: tuple[Tree | DynamicTree, ...],
                    device: torch.device, load: LoadMeter) -> dict[int, float]:
    """ms per captured step of each of `trees` (by tokens per step) in the dtype whose captured Medusa step
    `profile` timed fastest, with the fastest plain step of the same rounds as size 1: SIZE_STEPS steps per
    timing, as the sizes are a few % apart."""
    dtype, _, _ = GraphProfile.fastest(profile.step_ms)
    plain_dtype, plain_captured, _ = GraphProfile.fastest(profile.plain_ms)
    calls = (ROUNDS + 1) * SIZE_STEPS
    runners = {len(tree) + 1: step_runner(models[dtype], calls, tree, step_heads[dtype], GRAPH_CONTEXT, True)
               for tree in trees}
    runners[1] = step_runner(models[plain_dtype], calls, context=GRAPH_CONTEXT, captured=plain_captured)
    ms = interleaved_ms({tokens: _several(run) for tokens, run in runners.items()}, ROUNDS, device, load=load)
    return {tokens: round(total / SIZE_STEPS, 3) for tokens, total in ms.items()}


def _last_line(error: Exception) -> str:
    """What a failing compiled kernel says, in one line: the last line of its message (at most 200 characters)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1][:200]


def _several(run: Callable[[], None], count: int = SIZE_STEPS) -> Callable[[], None]:
    """`run` `count` times per call."""
    def run_several() -> None:
        for _ in range(count):
            run()

    return run_several


def _checked_pair(table: dict) -> dict[str, float]:
    values = {mode: float(table[mode]) for mode in ("eager", "captured")}
    if not all(math.isfinite(ms) and ms > 0 for ms in values.values()):
        raise ValueError("step times must be positive numbers")
    return values
