"""Medusa heads on top of an unmodified transformers causal LM, and the files they live in.

Each head is `medusa_num_layers` ResBlocks (x + SiLU(Wx + b), zero-initialised, so an untrained head
starts as the identity) followed by a vocabulary projection. Head i, applied to the hidden state of
token t, predicts token t+2+i. Two layouts:

- `shared_lm_head`: the projection is the base model's own lm_head. A 153k-vocabulary head costs
  ~0.2% of the base weights per step instead of +9% each; the default for new heads.
- `own_lm_head`: each head ends in its own Linear(hidden, vocab), as in upstream Medusa and the
  reference OpenPangu heads.

Files: a heads directory holds `config.json` (heads-only) and `medusa_lm_head.safetensors` (or `.pt`)
with keys relative to the head list (`{i}.{j}.linear.weight`, `{i}.{n}.weight` for own_lm_head).
A combined directory holds a base model's files with the heads beside them (`medusa_config.json` +
`medusa_lm_head.safetensors`).
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

LAYOUTS = ("shared_lm_head", "own_lm_head")
HEADS_WEIGHTS = "medusa_lm_head.safetensors"
HEADS_WEIGHTS_PT = "medusa_lm_head.pt"
COMBINED_CONFIG = "medusa_config.json"


class MedusaLoadError(ValueError):
    """Heads that do not fit the base model, or files that are missing or malformed."""


@dataclass
class MedusaConfig:
    medusa_num_heads: int
    medusa_num_layers: int = 1
    medusa_head_layout: str = "shared_lm_head"
    hidden_size: int | None = None
    vocab_size: int | None = None
    base_model_name_or_path: str | None = None
    medusa_choices: str | list | None = None  # the tree these heads were tuned with

    def __post_init__(self):
        if self.medusa_head_layout not in LAYOUTS:
            raise MedusaLoadError(f"medusa_head_layout must be one of {LAYOUTS}, not {self.medusa_head_layout!r}")
        if self.medusa_num_heads < 1 or self.medusa_num_layers < 0:
            raise MedusaLoadError("medusa_num_heads must be >= 1 and medusa_num_layers >= 0")

    @classmethod
    def from_dict(cls, data: dict) -> "MedusaConfig":
        if "medusa_num_heads" not in data:
            raise MedusaLoadError("the Medusa config has no medusa_num_heads")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        # Upstream Medusa configs predate layouts: their heads always carry their own lm_head.
        fields.setdefault("medusa_head_layout", "own_lm_head")
        return cls(**fields)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); zero weights make it the identity, so untrained heads echo the base model."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """The list of heads; its state_dict keys are the upstream file format (`{i}.{j}.linear.weight`)."""

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int):
        own = config.medusa_head_layout == "own_lm_head"
        super().__init__(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(config.medusa_num_layers)],
                *([nn.Linear(hidden_size, vocab_size, bias=False)] if own else []),
            )
            for _ in range(config.medusa_num_heads)
        )
        self.config = config
        self.own_lm_head = own

    @property
    def num_heads(self) -> int:
        return len(self)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, num_heads: int | None = None) -> torch.Tensor:
        """Logits [num_heads, *hidden.shape[:-1], vocab] of the first `num_heads` heads."""
        heads = list(self)[: num_heads or len(self)]
        if self.own_lm_head:
            return torch.stack([head(hidden) for head in heads])
        return lm_head(torch.stack([head(hidden) for head in heads]))

    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """Own-lm_head heads start from the base lm_head (as upstream Medusa does)."""
        if self.own_lm_head:
            for head in self:
                head[-1].weight.data.copy_(lm_head.weight.data)


def read_medusa_config(directory: Path) -> MedusaConfig | None:
    """The heads config in a heads dir (config.json) or a combined dir (medusa_config.json); None if absent."""
    for name in (COMBINED_CONFIG, "config.json"):
        path = directory / name
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as error:
                raise MedusaLoadError(f"{path} is not valid JSON: {error}") from None
            if "medusa_num_heads" in data:
                return MedusaConfig.from_dict(data)
    return None


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / HEADS_WEIGHTS).is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(directory / HEADS_WEIGHTS))
        except (SafetensorError, OSError) as error:
            raise MedusaLoadError(f"{directory / HEADS_WEIGHTS} is unreadable: {error}") from None
    if (directory / HEADS_WEIGHTS_PT).is_file():
        return torch.load(directory / HEADS_WEIGHTS_PT, map_location="cpu", weights_only=True)
    raise MedusaLoadError(f"no Medusa head weights ({HEADS_WEIGHTS} or {HEADS_WEIGHTS_PT}) in {directory}")


def load_heads(directory: str | os.PathLike, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Load heads strictly: a size or key that does not fit is an error, never silently random weights."""
    directory = Path(directory)
    config = read_medusa_config(directory)
    if config is None:
        raise MedusaLoadError(f"{directory} has no Medusa config (config.json or {COMBINED_CONFIG} with medusa_num_heads)")
    for name, expected in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        declared = getattr(config, name)
        if declared is not None and declared != expected:
            raise MedusaLoadError(f"the heads in {directory} were made for {name}={declared}, the base model has {expected}")
    heads = MedusaHeads(config, hidden_size, vocab_size)
    state = _read_state_dict(directory)
    expected_shapes = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    missing = sorted(set(expected_shapes) - set(state))
    unexpected = sorted(set(state) - set(expected_shapes))
    if missing or unexpected:
        raise MedusaLoadError(
            f"the head weights in {directory} do not match {config.medusa_num_heads} heads x "
            f"{config.medusa_num_layers} layers ({config.medusa_head_layout}): "
            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}"
        )
    for key, shape in expected_shapes.items():
        if tuple(state[key].shape) != shape:
            raise MedusaLoadError(
                f"{key} in {directory} has shape {tuple(state[key].shape)}, the base model needs {shape} "
                "(heads trained for another model?)"
            )
    heads.load_state_dict(state)
    return heads


def save_heads(heads: MedusaHeads, directory: str | os.PathLike, combined: bool = False) -> None:
    """Write heads as safetensors + config; `combined` puts the config in medusa_config.json (beside a base)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(state, str(directory / HEADS_WEIGHTS), metadata={"format": "pt"})
    (directory / (COMBINED_CONFIG if combined else "config.json")).write_text(
        json.dumps(heads.config.to_dict(), indent=2) + "\n"
    )
