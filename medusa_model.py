"""Medusa heads on top of an unmodified transformers causal LM, and the files they live in.

Each head is `medusa_num_layers` ResBlocks (x + SiLU(Wx + b), zero-initialised, so an untrained head
starts as the identity) followed by a vocabulary projection. Head i, applied to the hidden state of
token t, predicts token t+2+i. Two layouts:

- `shared_lm_head`: the projection is the base model's own lm_head. A 153k-vocabulary head costs
  ~0.2% of the base weights per step instead of +9% each; the default for new heads.
- `own_lm_head`: each head ends in its own Linear(hidden, vocab), as in upstream Medusa and the
  reference OpenPangu heads.

Heads read either the hidden state alone (`medusa_head_input="hidden"`, upstream Medusa) or, with
`"hidden_and_next_token"`, also the embedding of token t+1: the token the base model has just chosen at
that position (the root of the next tree), so head 0 no longer has to guess it. Such a head starts with a
Linear([hidden; embedding] -> hidden) initialised to pass the hidden state through.

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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

LAYOUTS = ("shared_lm_head", "own_lm_head")
HEAD_INPUTS = ("hidden", "hidden_and_next_token")
HEADS_WEIGHTS = "medusa_lm_head.safetensors"
HEADS_WEIGHTS_PT = "medusa_lm_head.pt"
COMBINED_CONFIG = "medusa_config.json"
ONE_CHECKPOINT_PREFIX = "medusa_head."
LAYOUTS_ON_DISK = ("heads", "combined", "one_checkpoint")


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
    medusa_head_input: str = "hidden"
    medusa_draft_vocab_size: int | None = None  # proposals only from these most frequent tokens

    def __post_init__(self):
        if self.medusa_head_layout not in LAYOUTS:
            raise MedusaLoadError(f"medusa_head_layout must be one of {LAYOUTS}, not {self.medusa_head_layout!r}")
        if self.medusa_head_input not in HEAD_INPUTS:
            raise MedusaLoadError(f"medusa_head_input must be one of {HEAD_INPUTS}, not {self.medusa_head_input!r}")
        if self.medusa_num_heads < 1 or self.medusa_num_layers < 0:
            raise MedusaLoadError("medusa_num_heads must be >= 1 and medusa_num_layers >= 0")
        if self.medusa_draft_vocab_size is not None:
            if self.medusa_head_layout != "shared_lm_head":
                raise MedusaLoadError("a draft vocabulary needs shared_lm_head heads")
            if self.medusa_draft_vocab_size < 1:
                raise MedusaLoadError("medusa_draft_vocab_size must be >= 1")

    @classmethod
    def from_dict(cls, data: dict) -> "MedusaConfig":
        if "medusa_num_heads" not in data:
            raise MedusaLoadError("the Medusa config has no medusa_num_heads")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        # Upstream Medusa configs predate layouts: their heads always carry their own lm_head.
        fields.setdefault("medusa_head_layout", "own_lm_head")
        return cls(**fields)

    def to_dict(self) -> dict:
        """Fields that are set; the default head input is left out so upstream-style configs stay upstream's."""
        data = {k: v for k, v in asdict(self).items() if v is not None}
        if data["medusa_head_input"] == "hidden":
            del data["medusa_head_input"]
        return data


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); zero weights make it the identity, so untrained heads echo the base model."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class NextTokenInput(nn.Linear):
    """Linear([hidden; embedding of token t+1]) -> hidden, starting as a pass-through of the hidden state."""

    def __init__(self, hidden_size: int):
        super().__init__(2 * hidden_size, hidden_size)
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.bias.zero_()


class MedusaHeads(nn.ModuleList):
    """The list of heads; its state_dict keys are the upstream file format (`{i}.{j}.linear.weight`)."""

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int):
        own = config.medusa_head_layout == "own_lm_head"
        reads_next_token = config.medusa_head_input == "hidden_and_next_token"
        super().__init__(
            nn.Sequential(
                *([NextTokenInput(hidden_size)] if reads_next_token else []),
                *[ResBlock(hidden_size) for _ in range(config.medusa_num_layers)],
                *([nn.Linear(hidden_size, vocab_size, bias=False)] if own else []),
            )
            for _ in range(config.medusa_num_heads)
        )
        self.config = config
        self.own_lm_head = own
        self.reads_next_token = reads_next_token
        if config.medusa_draft_vocab_size is not None:
            self.register_buffer("draft_vocab", torch.zeros(config.medusa_draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None

    @property
    def num_heads(self) -> int:
        return len(self)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, num_heads: int | None = None,
                next_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [num_heads, *hidden.shape[:-1], vocab] of the first `num_heads` heads.

        `next_embeds` [*hidden.shape]: input embeddings of token t+1, required by next-token heads.
        """
        if self.own_lm_head:
            return self.states(hidden, num_heads, next_embeds)
        # fp32 heads over a bf16 lm_head
        return lm_head(self.states(hidden, num_heads, next_embeds).to(lm_head.weight.dtype))

    def next_token_embeds(self, embeddings: nn.Module, next_ids: torch.Tensor) -> torch.Tensor | None:
        """The `next_embeds` these heads take: embeddings of token t+1, or None for hidden-only heads."""
        return embeddings(next_ids) if self.reads_next_token else None

    def states(self, hidden: torch.Tensor, num_heads: int | None = None,
               next_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The heads' outputs [num_heads, *hidden.shape[:-1], -1]: logits for own_lm_head, else the states
        that go through the shared lm_head."""
        if self.reads_next_token:
            if next_embeds is None:
                raise ValueError("these heads read token t+1: pass next_embeds")
            hidden = torch.cat([hidden, next_embeds.to(hidden.dtype)], dim=-1)
        return torch.stack([head(hidden) for head in list(self)[: num_heads or len(self)]])

    def proposal_lm_head(self, lm_head: nn.Linear) -> nn.Linear:
        """The projection proposals are scored with: the shared lm_head cut to the draft vocabulary (a copy:
        build it once, not per step), or the lm_head itself. Map its output indices back with `token_ids`."""
        if self.draft_vocab is None:
            return lm_head
        rows = nn.Linear(lm_head.in_features, len(self.draft_vocab), bias=False, device="meta")
        weight = lm_head.weight.detach().index_select(0, self.draft_vocab.to(lm_head.weight.device))
        rows.weight = nn.Parameter(weight, requires_grad=False)
        return rows

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of indices into the `proposal_lm_head` output."""
        return indices if self.draft_vocab is None else self.draft_vocab[indices]

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
            f"{config.medusa_num_layers} layers ({config.medusa_head_layout}, input {config.medusa_head_input}): "
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
    if heads.draft_vocab is not None and not (0 <= int(heads.draft_vocab.min()) and int(heads.draft_vocab.max()) < vocab_size):
        raise MedusaLoadError(f"the draft vocabulary in {directory} holds ids outside the base vocabulary ({vocab_size})")
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


def default_tree_name(device_type: str, num_heads: int) -> str:
    """Small trees where tree tokens cost real time (CPU); upstream's 63-node tree on accelerators."""
    if device_type == "cpu":
        return "tree_8"
    return "mc_sim_7b_63" if num_heads >= 4 else "openpangu_3head"


def _has_weights(directory: Path) -> bool:
    return any((directory / name).exists() for name in ("model.safetensors", "model.safetensors.index.json"))


class MedusaModel(nn.Module):
    """A base causal LM plus Medusa heads; `medusa_generate` decodes with tree verification."""

    def __init__(self, base_model: nn.Module, heads: MedusaHeads, tokenizer=None, tree=None):
        super().__init__()
        from inference.medusa_decoding import MedusaDecoder

        self.base_model = base_model
        self.medusa_head = heads.to(device=base_model.device, dtype=base_model.dtype)
        self.tokenizer = tokenizer
        self.decoder = MedusaDecoder(base_model, self.medusa_head)
        self.tree = tree if tree is not None else self._configured_tree()

    @property
    def config(self):
        return self.base_model.config

    def _configured_tree(self):
        from medusa_choices import load_tree

        configured = self.medusa_head.config.medusa_choices
        if isinstance(configured, list):
            return configured
        name = configured or default_tree_name(self.base_model.device.type, self.medusa_head.num_heads)
        return [p for p in load_tree(name) if len(p) <= self.medusa_head.num_heads]

    @classmethod
    def untrained(cls, base_model: nn.Module, num_heads: int = 4, num_layers: int = 1,
                  layout: str = "shared_lm_head", tokenizer=None) -> "MedusaModel":
        """Fresh heads (identity ResBlocks): correct output at about one token per step; a start for training."""
        config = MedusaConfig(num_heads, num_layers, layout, base_model.config.hidden_size,
                              base_model.config.vocab_size, getattr(base_model.config, "_name_or_path", None))
        heads = MedusaHeads(config, base_model.config.hidden_size, base_model.config.vocab_size)
        heads.init_from_lm_head(base_model.lm_head)
        return cls(base_model, heads, tokenizer)

    @classmethod
    def from_pretrained(cls, base_model: str | None, medusa: str | None = None, device: str = "auto",
                        dtype: str = "auto", tree=None) -> "MedusaModel":
        """Base and heads from separate directories / Hub ids, or one combined directory (`medusa=None`).

        When `base_model` is a heads-only directory, its `base_model_name_or_path` names the base.
        """
        from inference.demo_model import DEMO_NAME
        from inference.devices import resolve_device, resolve_dtype
        from inference.loading import load_base, resolve_model_dir

        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        if medusa:
            heads_dir = resolve_model_dir(medusa)
        elif base_model is not None:
            heads_dir = resolve_model_dir(base_model)  # a combined or a heads-only directory
        else:
            raise MedusaLoadError("no Medusa heads given: pass a heads directory or a combined directory")
        config = read_medusa_config(heads_dir)
        if config is None:
            raise MedusaLoadError(f"{heads_dir} holds no Medusa heads (config.json or {COMBINED_CONFIG})")
        if not medusa:
            base_model = str(heads_dir) if _has_weights(heads_dir) else config.base_model_name_or_path
        elif base_model is None:
            base_model = config.base_model_name_or_path
        if base_model == DEMO_NAME:
            base_model = None
        model, tokenizer, _ = load_base(base_model, torch_device, torch_dtype)
        heads = load_heads(heads_dir, model.config.hidden_size, model.config.vocab_size)
        return cls(model, heads, tokenizer, tree)

    def save_pretrained(self, directory: str | os.PathLike, layout: str = "heads") -> None:
        """`heads`: heads only (config.json + medusa_lm_head.safetensors); `combined`: base files with the
        heads beside them; `one_checkpoint`: heads inside the model's safetensors, fields in its config.json."""
        if layout not in LAYOUTS_ON_DISK:
            raise ValueError(f"layout must be one of {LAYOUTS_ON_DISK}")
        if layout == "heads":
            save_heads(self.medusa_head, directory)
            return
        if layout == "combined":
            self.base_model.save_pretrained(directory)
            save_heads(self.medusa_head, directory, combined=True)
        else:
            state = dict(self.base_model.state_dict())
            state.update({ONE_CHECKPOINT_PREFIX + k: v for k, v in self.medusa_head.state_dict().items()})
            self.base_model.save_pretrained(directory, state_dict=state)
            config_path = Path(directory) / "config.json"
            config = json.loads(config_path.read_text())
            fields = self.medusa_head.config.to_dict()
            fields.pop("base_model_name_or_path", None)
            config.update(fields, medusa_choices=self.tree)
            config_path.write_text(json.dumps(config, indent=2) + "\n")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)

    def medusa_generate(self, input_ids, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                        acceptance: str | None = None, posterior_threshold: float = 0.09,
                        posterior_alpha: float = 0.3, eos_token_id=None, seed: int | None = None, tree=None,
                        stats=None):
        """Yield lists of new token ids, one list per verification step (batch size 1)."""
        from inference.decoding import DecodeRequest
        from inference.medusa_decoding import Acceptance, default_rule
        from inference.sampling import Sampling

        ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise ValueError(f"Medusa decoding supports batch size 1, got {len(ids)} sequences")
            ids = ids[0]
        if eos_token_id is None:
            eos_token_id = self.base_model.generation_config.eos_token_id
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id or ())
        rule = acceptance or default_rule(temperature)
        request = DecodeRequest(ids, max_new_tokens, eos, Sampling(temperature, top_p), seed)
        return self.decoder.decode(request, tree or self.tree, Acceptance(rule, posterior_threshold, posterior_alpha), stats)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, eos_token_id=None,
                 streamer=None, seed: int | None = None, **unused) -> torch.Tensor:
        """transformers-style `generate` with Medusa decoding underneath: returns prompt + new ids [1, L].

        Greedy (`do_sample=False`) equals HF greedy `generate`; sampling is lossless. Batch size 1;
        left padding in `attention_mask` is dropped. A `streamer` gets the prompt, then each step's ids.
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"Medusa generate supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}")
        prompt = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]
        if streamer is not None:
            streamer.put(prompt.unsqueeze(0).cpu())
        new: list[int] = []
        for step in self.medusa_generate(prompt.tolist(), max_new_tokens=max_new_tokens,
                                         temperature=temperature if do_sample else 0.0, top_p=top_p if do_sample else 1.0,
                                         eos_token_id=eos_token_id, seed=seed):
            new.extend(step)
            if streamer is not None:
                streamer.put(torch.tensor(step))
        if streamer is not None:
            streamer.end()
        return torch.cat([prompt, torch.tensor(new, dtype=prompt.dtype, device=prompt.device)]).unsqueeze(0)
