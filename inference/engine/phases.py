"""Where a decoding step's time goes: drafting, the forward, acceptance and the KV keep, and the host's work
between steps. Timed only when asked (`benchmark.py --profile_phases`): each phase ends with a device
synchronisation that a normal step avoids. A captured step is one graph, so it is one phase."""

import time
from collections import Counter

import torch

DRAFTING, FORWARD, ACCEPTANCE, HOST, CAPTURED = "drafting", "forward", "acceptance and KV keep", "host", "captured step"
PHASES = (DRAFTING, FORWARD, ACCEPTANCE, CAPTURED, HOST)  # in the order a step runs them


class PhaseClock:
    """Seconds per phase over the steps of one decode; `mark(phase)` ends the phase that ran since the last mark."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: Counter = Counter()
        self._since: float | None = None

    def _now(self) -> float:
        if self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._since = self._now()

    def mark(self, phase: str) -> None:
        if self._since is not None:
            now = self._now()
            self.seconds[phase] += now - self._since
            self._since = now

    def stop(self) -> None:
        self._since = None


class _NoClock:
    """What a step marks when nothing is timed (and inside every captured step): nothing, at no cost."""

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def stop(self) -> None:
        pass


NO_CLOCK = _NoClock()
