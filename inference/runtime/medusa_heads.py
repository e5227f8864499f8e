"""Medusa heads and the files they live in (the public API over them is medusa_model.py).

Each head is `medusa_num_layers` ResBlocks (x + SiLU(Wx + b), zero-initialised, so an untrained head
starts as the identity) followed by a vocabulary projection. Head i, applied to the hidden state of
token t, predicts token t+2+i. Two layouts:

- `shared_lm_head`: the projection is the base model's own lm_head. A 153k-vocabulary head costs
  ~0.2% of the base weights per step instead of +9% each; the default for new heads.
- `own_lm_head`: each head ends in its own Linear(hidden, vocab), as in upstream Medusa and the
  reference OpenPangu heads.

Heads read the hidden state alone (`medusa_head_input="hidden"`, upstream Medusa) or also the embeddings of
tokens the tree has already put in front of them:
- `"hidden_and_next_token"`: token t+1, the token the base model has just chosen at that position (the
  root of the next tree), so head 0 no longer has to guess it.
- `"hidden_and_path"` (sequentially dependent, as in Hydra): head i reads tokens t+1 .. t+1+i, the root and
  the candidates on its tree path, so head i predicts t+2+i knowing what the heads before it proposed. The
  tree is then drafted level by level (one batched call of head i over the nodes of level i).
Such a head starts with a Linear([hidden; embeddings] -> hidden) initialised to pass the hidden state through.
- `"features"`: not heads but an EAGLE-style feature drafter, a decoder layer (or a few) over the base model's
  features with a KV cache of its own (inference/runtime/feature_drafter.py; `build_heads` makes either).

Shared-lm_head heads may carry a draft vocabulary (`medusa_draft_vocab_size` ids, the `draft_vocab`
tensor): the tokens the base model emits most often. Proposals are then scored over those rows of the
lm_head only: the heads' projection costs K/V of a full one, and the tokens left out are ones a head
rarely gets right anyway. Verification always uses the full vocabulary, so the output is unchanged.

Files: a heads directory holds `config.json` (heads-only) and `medusa_lm_head.safetensors` (or `.pt`)
with keys relative to the head list (`{i}.{j}.linear.weight`, `{i}.{n}.weight` for own_lm_head).
A combined directory holds a base model's files with the heads beside them (`medusa_config.json` +
`medusa_lm_head.safetensors`). A one-checkpoint directory (upstream Medusa's "1.0" layout) keeps the
heads inside the model's own safetensors as `medusa_head.{i}...` keys and the Medusa fields
(`medusa_num_heads`, `medusa_num_layers`, `medusa_choices`) in the model's config.json.
"""

import json
import os
from pathlib import Path

import torch
from torch import nn

from inference.runtime.drafter_config import (HEAD_INPUTS, LAYOUTS, MEDUSA_HEAD_INPUTS, DraftVocabulary,  # noqa: F401
                                              MedusaConfig, MedusaLoadError)
from inference.runtime.errors import first_line
from inference.runtime.feature_drafter import FeatureDrafter
from inference.runtime.outputs import replace_atomic, write_atomic

HEADS_WEIGHTS = "medusa_lm_head.safetensors"
HEADS_WEIGHTS_PT = "medusa_lm_head.pt"
COMBINED_CONFIG = "medusa_config.json"
ONE_CHECKPOINT_PREFIX = "medusa_head."
LAYOUTS_ON_DISK = ("heads", "combined", "one_checkpoint")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); zero weights make it the identity, so untrained heads echo the base model."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def token_input(hidden_size: int, tokens: int) -> nn.Linear:
    """Linear([hidden; embeddings of `tokens` tokens]) -> hidden, starting as a pass-through of the hidden state
    (a plain nn.Linear, so whatever speeds up linears speeds it up too)."""
    linear = nn.Linear((1 + tokens) * hidden_size, hidden_size)
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
        linear.bias.zero_()
    return linear


def tokens_read_by(head_input: str, head: int) -> int:
    """How many tokens after t (t+1, t+2, ...) head `head` reads besides the hidden state of token t."""
    return {"hidden": 0, "hidden_and_next_token": 1, "hidden_and_path": head + 1}[head_input]


class MedusaHeads(DraftVocabulary, nn.ModuleList):
    """The list of heads; its state_dict keys are the upstream file format (`{i}.{j}.linear.weight`)."""

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int):
        if config.medusa_head_input not in MEDUSA_HEAD_INPUTS:
            raise MedusaLoadError(f"{config.medusa_head_input!r} is not a Medusa head input (build_heads makes that drafter)")
        own = config.medusa_head_layout == "own_lm_head"
        reads = [tokens_read_by(config.medusa_head_input, i) for i in range(config.medusa_num_heads)]
        super().__init__(
            nn.Sequential(
                *([token_input(hidden_size, tokens)] if tokens else []),
                *[ResBlock(hidden_size) for _ in range(config.medusa_num_layers)],
                *([nn.Linear(hidden_size, vocab_size, bias=False)] if own else []),
            )
            for tokens in reads
        )
        self.config = config
        self.vocab_size = vocab_size
        self.own_lm_head = own
        self.tokens_per_head = reads  # how many tokens after t each head reads
        self.reads_tokens = any(reads)
        self.sequential = config.medusa_head_input == "hidden_and_path"
        self.init_draft_vocab(config)

    @property
    def num_heads(self) -> int:
        return len(self)

    @property
    def propose_after_verification(self) -> bool:
        """Whether proposals run after a step's verification: heads that read token t+1 need the base model's
        choice of it, and own or draft-vocabulary projections are not the verification's lm_head. Only plain
        shared-lm_head heads can ride along in the verification's lm_head pass."""
        return self.own_lm_head or self.reads_tokens or self.draft_vocab is not None

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, num_heads: int | None = None,
                token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [num_heads, *hidden.shape[:-1], vocab] of the first `num_heads` heads.

        `token_embeds` [*hidden.shape[:-1], k, hidden]: input embeddings of tokens t+1 .. t+k, required by heads
        that read tokens (k >= the most any of them reads; in training, the true tokens: teacher forcing).
        """
        return self.project(self.states(hidden, num_heads, token_embeds), lm_head)

    def project(self, states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits of the heads' outputs: theirs already for own_lm_head, else through the shared lm_head."""
        if self.own_lm_head:
            return states
        return lm_head(states.to(lm_head.weight.dtype))  # fp32 heads over a bf16 lm_head

    def token_embeds(self, embeddings: nn.Module, following_ids: torch.Tensor) -> torch.Tensor | None:
        """The `token_embeds` these heads take from token ids [..., k] (t+1 .. t+k), or None if they read none."""
        return embeddings(following_ids[..., : max(self.tokens_per_head)]) if self.reads_tokens else None

    def head_state(self, head: int, hidden: torch.Tensor, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The output of one head [*hidden.shape[:-1], -1]: logits for own_lm_head, else the state that goes
        through the shared lm_head."""
        tokens = self.tokens_per_head[head]
        if tokens:
            if token_embeds is None or token_embeds.shape[-2] < tokens:
                raise ValueError(f"head {head} reads the {tokens} token(s) after t: pass token_embeds")
            read = token_embeds[..., :tokens, :].flatten(-2).to(hidden.dtype)
            hidden = torch.cat([hidden, read], dim=-1)
        return self[head](hidden)

    def states(self, hidden: torch.Tensor, num_heads: int | None = None,
               token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The first `num_heads` heads' outputs [num_heads, *hidden.shape[:-1], -1] (see `head_state`)."""
        return torch.stack([self.head_state(i, hidden, token_embeds) for i in range(num_heads or len(self))])

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
            if isinstance(data, dict) and "medusa_num_heads" in data:
                return MedusaConfig.from_dict(data)
    return None


def heads_config_path(directory: Path) -> Path:
    """The file that holds the heads' config: medusa_config.json beside a base model (combined), the
    model's own config.json (one checkpoint), else the heads directory's config.json."""
    return directory / COMBINED_CONFIG if (directory / COMBINED_CONFIG).is_file() else directory / "config.json"


def has_base_weights(directory: Path) -> bool:
    return any((directory / name).exists() for name in ("model.safetensors", "model.safetensors.index.json"))


def is_one_checkpoint(directory: Path) -> bool:
    """A model directory whose own config.json carries the Medusa fields (heads inside its weights)."""
    path = directory / "config.json"
    if not path.is_file() or (directory / HEADS_WEIGHTS).is_file() or (directory / HEADS_WEIGHTS_PT).is_file():
        return False
    config = json.loads(path.read_text())
    return "medusa_num_heads" in config and "model_type" in config


def _model_weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [directory / "model.safetensors"]


def _read_one_checkpoint_heads(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state = {}
    for file in _model_weight_files(directory):
        with safe_open(str(file), framework="pt") as weights:
            for key in weights.keys():
                if key.startswith(ONE_CHECKPOINT_PREFIX):
                    state[key[len(ONE_CHECKPOINT_PREFIX) :]] = weights.get_tensor(key)
    return state


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    if is_one_checkpoint(directory):
        return _read_one_checkpoint_heads(directory)
    if (directory / HEADS_WEIGHTS).is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(directory / HEADS_WEIGHTS))
        except (SafetensorError, OSError) as error:
            raise MedusaLoadError(f"{directory / HEADS_WEIGHTS} is unreadable: {error}") from None
    if (directory / HEADS_WEIGHTS_PT).is_file():
        try:
            state = torch.load(directory / HEADS_WEIGHTS_PT, map_location="cpu", weights_only=True)
        except Exception as error:  # truncated or not a torch file: torch raises several kinds
            raise MedusaLoadError(f"{directory / HEADS_WEIGHTS_PT} is unreadable: {type(error).__name__}: "
                                  f"{first_line(error)}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise MedusaLoadError(f"{directory / HEADS_WEIGHTS_PT} does not hold a state dict of tensors")
        return state
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
    return heads_from_state(config, _read_state_dict(directory), hidden_size, vocab_size, str(directory))


def build_heads(config: MedusaConfig, hidden_size: int, vocab_size: int) -> nn.Module:
    """Untrained heads of `config`: Medusa heads, or the feature drafter for `medusa_head_input` "features"."""
    if config.medusa_head_input == "features":
        return FeatureDrafter(config, hidden_size, vocab_size)
    return MedusaHeads(config, hidden_size, vocab_size)


def heads_from_state(config: MedusaConfig, state: dict[str, torch.Tensor], hidden_size: int, vocab_size: int,
                     source: str) -> nn.Module:
    """Heads of `config` with the weights `state` (read from `source`), checked key by key and shape by shape."""
    heads = build_heads(config, hidden_size, vocab_size)
    expected_shapes = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    missing = sorted(set(expected_shapes) - set(state))
    unexpected = sorted(set(state) - set(expected_shapes))
    if missing or unexpected:
        raise MedusaLoadError(
            f"the head weights in {source} do not match {config.medusa_num_heads} heads x "
            f"{config.medusa_num_layers} layers ({config.medusa_head_layout}, input {config.medusa_head_input}): "
            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}"
        )
    for key, shape in expected_shapes.items():
        if tuple(state[key].shape) != shape:
            raise MedusaLoadError(
                f"{key} in {source} has shape {tuple(state[key].shape)}, the base model needs {shape} "
                "(heads trained for another model?)"
            )
    heads.load_state_dict(state)
    if heads.draft_vocab is not None:
        ids = heads.draft_vocab.tolist()
        if not all(0 <= i < vocab_size for i in ids):
            raise MedusaLoadError(f"the draft vocabulary in {source} holds ids outside the base vocabulary ({vocab_size})")
        if len(set(ids)) != len(ids):
            # Siblings could then carry equal tokens, and sampled acceptance would no longer be lossless.
            raise MedusaLoadError(f"the draft vocabulary in {source} lists a token more than once")
    return heads


def save_heads(heads: MedusaHeads, directory: str | os.PathLike, combined: bool = False) -> None:
    """Write heads as safetensors + config; `combined` puts the config in medusa_config.json (beside a base).
    Each file is replaced atomically, the config last: an interrupted save leaves the old heads loadable."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    replace_atomic(directory / HEADS_WEIGHTS, lambda staging: save_file(state, str(staging), metadata={"format": "pt"}))
    write_heads_config(heads.config, directory / (COMBINED_CONFIG if combined else "config.json"))


def write_heads_config(config: MedusaConfig, path: str | os.PathLike) -> None:
    """The one writer of heads configs: `config` as the whole file at `path`, atomically."""
    write_atomic(path, json.dumps(config.to_dict(), indent=2) + "\n")


def update_heads_config(path: str | os.PathLike, fields: dict) -> None:
    """Merge `fields` into the config at `path` (a heads, combined or one-checkpoint config, whose other
    fields stay), atomically, after checking that the result is still a valid heads config."""
    config = json.loads(Path(path).read_text()) | fields
    MedusaConfig.from_dict(config)
    write_atomic(path, json.dumps(config, indent=2) + "\n")
