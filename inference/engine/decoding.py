"""What plain and Medusa decoding share: the request, stopping rules and per-call statistics."""

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from inference.engine.phases import PhaseClock
from inference.engine.sampling import Sampling


@dataclass
class DecodeStats:
    """Per-call numbers. `steps` and `accept_lengths` (tokens emitted per step, 1 = no gain from speculation)
    count decoding steps after the prefill, whose single token is in `new_tokens` only."""

    new_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0  # of `seconds`, spent capturing steps (first calls of new shapes)
    accept_lengths: Counter = field(default_factory=Counter)
    step_sizes: Counter = field(default_factory=Counter)  # tokens verified per step (1: a plain step) -> steps
    switches: int = 0  # times the schedule changed its choice of step (probes not counted)
    phases: PhaseClock | None = None  # set by the caller to time each step's phases (inference/engine/phases.py)

    @property
    def tokens_per_step(self) -> float:
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed, the time spent compiling left out."""
        seconds = self.seconds - self.compile_seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "seconds": round(self.seconds, 4),
            "compile_seconds": round(self.compile_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "accept_lengths": {str(k): v for k, v in sorted(self.accept_lengths.items())},
            "step_sizes": {str(k): v for k, v in sorted(self.step_sizes.items())},
            "switches": self.switches,
        }


@dataclass
class DecodeRequest:
    input_ids: list[int]
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    sampling: Sampling = Sampling()
    seed: int | None = None

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.sampling.greedy:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed if self.seed is not None else torch.seed())
        return generator


def check_request(request: DecodeRequest, max_positions: int | None) -> None:
    """Reject requests that cannot run, with a message that says what to change."""
    if not request.input_ids:
        raise ValueError("the prompt is empty")
    if request.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    total = len(request.input_ids) + request.max_new_tokens
    if max_positions and total > max_positions:
        raise ValueError(
            f"prompt ({len(request.input_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} "
            f"exceeds the model's context of {max_positions} positions: shorten the prompt or lower max_new_tokens"
        )


def eos_ids(*sources: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """One sorted tuple of EOS ids from any mix of None, single ids and lists (transformers configs allow all)."""
    ids = set()
    for source in sources:
        ids |= {source} if isinstance(source, int) else set(source or ())
    return tuple(sorted(ids))


class StepEmitter:
    """Applies the stopping rules to each step's tokens: cut after EOS, never exceed max_new_tokens."""

    def __init__(self, request: DecodeRequest, stats: DecodeStats):
        self.remaining = request.max_new_tokens
        self.eos = set(request.eos_token_ids)
        self.stats = stats
        self.done = False
        self.prefilled = False
        self.started = time.perf_counter()

    def emit(self, tokens: list[int]) -> list[int]:
        if self.prefilled:
            self.stats.steps += 1
            self.stats.accept_lengths[len(tokens)] += 1
        self.prefilled = True
        for i, token in enumerate(tokens):
            if token in self.eos:
                tokens, self.done = tokens[: i + 1], True
                break
        if len(tokens) >= self.remaining:
            tokens, self.done = tokens[: self.remaining], True
        self.remaining -= len(tokens)
        self.stats.new_tokens += len(tokens)
        self.stats.seconds = time.perf_counter() - self.started
        return tokens
