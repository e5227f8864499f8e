"""Turning logits into tokens: greedy, or temperature / top-p sampling."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution plain sampling draws from: softmax(logits / T), restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / max(sampling.temperature, 1e-5), dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def exponential_race(rows: int, logits_width: int, sampling: Sampling, generator: torch.Generator | None,
                     device: torch.device) -> torch.Tensor | None:
    """The noise `choose_tokens` samples with, one Exp(1) draw per row and token [rows, V] (None when greedy).
    Drawn outside a captured step, which keeps its random state on the host side and the graph free of it."""
    if sampling.greedy:
        return None
    return torch.empty((rows, logits_width), device=device).exponential_(generator=generator)


def choose_tokens(logits: torch.Tensor, sampling: Sampling, race: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` [N, V]: argmax when greedy, else an independent draw per row from
    `race` [N, V] (`exponential_race`)."""
    if sampling.greedy:
        return logits.float().argmax(dim=-1)  # exact; CPU argmax over bf16 is ~2x slower than the cast + fp32 one
    # Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i, like
    # torch.multinomial, but without multinomial's checks that read the device.
    return (probabilities(logits, sampling) / race).argmax(dim=-1)
