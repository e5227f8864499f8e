"""The feature drafter: an EAGLE-style draft model, the fourth head design (`medusa_head_input: "features"`).

Medusa heads guess token t+2+i from one hidden state. The feature drafter is a decoder layer (or a few,
`medusa_num_layers`) of the base model's own kind and width that reads, at position p,
`fc([embedding(x[p+1]); feature(p)])` and predicts the feature of position p+1, whose projection through the
base model's lm_head gives token x[p+2]. The features are the base model's final hidden states (after its last
norm, what its lm_head reads) for accepted text, and the drafter's own predictions inside a draft, so every
drafted token sees the features of the ones before it and the drafter attends to the whole text through a KV
cache of its own. A fused drafter (config `medusa_feature_aux_layers`, after EAGLE-3) reads richer features
for the text: the final hidden states plus a learned map (`fuse`, zero at the start of training) of the
RMS-normalised inputs of some intermediate layers, which carry more of what follows than the final layer keeps;
inside a draft it reads its own predictions as before. As in EAGLE (and vLLM's `eagle` speculator, which loads
these weights), the first layer has no input norm and no norm follows the last.

Its config is a `MedusaConfig` whose `medusa_num_heads` is how many levels it drafts and whose
`medusa_feature_layer` describes its layers (read from the base model's config when the drafter is made, so the
files load without the base config). Weights: `fc.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.*`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.input_layernorm.weight` for i > 0, the optional `draft_vocab` buffer and, fused, `fuse.weight`.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from inference.engine.forward import rotary
from inference.runtime.drafter_config import DraftVocabulary, MedusaConfig, MedusaLoadError

LAYER_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "attention_bias",
                "rms_norm_eps", "hidden_act")


def feature_layer_fields(base_config) -> dict:
    """The description of a decoder layer like the base model's (`medusa_feature_layer`)."""
    heads = base_config.num_attention_heads
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(base_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(base_config, "head_dim", None) or base_config.hidden_size // heads,
        "intermediate_size": base_config.intermediate_size,
        # OpenPangu-Embedded puts a bias on q/k/v/o: its config says so with `bias` rather than `attention_bias`
        "attention_bias": bool(getattr(base_config, "attention_bias", False) or getattr(base_config, "bias", False)),
        "rms_norm_eps": base_config.rms_norm_eps,
        "hidden_act": getattr(base_config, "hidden_act", "silu"),
    }


def check_layer_fields(fields) -> None:
    if not isinstance(fields, dict) or sorted(fields) != sorted(LAYER_FIELDS):
        raise MedusaLoadError(f"medusa_feature_layer must give {', '.join(LAYER_FIELDS)}; got {fields!r:.120}")


class FeatureAttention(nn.Module):
    """The layer's projections (the attention itself runs where the keys are: see inference/engine)."""

    def __init__(self, hidden_size: int, fields: dict):
        super().__init__()
        bias, head_dim = fields["attention_bias"], fields["head_dim"]
        self.q_proj = nn.Linear(hidden_size, fields["num_attention_heads"] * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, fields["num_key_value_heads"] * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, fields["num_key_value_heads"] * head_dim, bias=bias)
        self.o_proj = nn.Linear(fields["num_attention_heads"] * head_dim, hidden_size, bias=bias)


class FeatureLayer(nn.Module):
    """A Llama-family decoder layer (module names as in the base model's layers); the first of a drafter has no
    input norm, as in EAGLE: it reads `fc`'s output."""

    def __init__(self, hidden_size: int, fields: dict, input_norm: bool):
        super().__init__()
        llama = LlamaConfig(hidden_size=hidden_size, intermediate_size=fields["intermediate_size"],
                            hidden_act=fields["hidden_act"], rms_norm_eps=fields["rms_norm_eps"])
        self.input_layernorm = LlamaRMSNorm(hidden_size, eps=fields["rms_norm_eps"]) if input_norm else None
        self.self_attn = FeatureAttention(hidden_size, fields)
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size, eps=fields["rms_norm_eps"])
        self.mlp = LlamaMLP(llama)


class FeatureDrafter(DraftVocabulary, nn.Module):
    """fc + `medusa_num_layers` decoder layers; drafts `config.medusa_num_heads` levels through the base model's
    lm_head."""

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int):
        super().__init__()
        if config.medusa_head_input != "features":
            raise MedusaLoadError(f"a feature drafter needs medusa_head_input 'features', not {config.medusa_head_input!r}")
        if config.medusa_head_layout != "shared_lm_head":
            raise MedusaLoadError("a feature drafter projects through the base model's lm_head: layout shared_lm_head")
        if config.medusa_num_layers < 1:
            raise MedusaLoadError("a feature drafter has at least one decoder layer (medusa_num_layers >= 1)")
        check_layer_fields(config.medusa_feature_layer)
        fields = config.medusa_feature_layer
        self.config = config
        self.vocab_size = vocab_size
        self.fields = fields
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList([FeatureLayer(hidden_size, fields, index > 0)
                                     for index in range(config.medusa_num_layers)])
        self.aux_layers = tuple(config.medusa_feature_aux_layers or ())
        self.fuse = nn.Linear(len(self.aux_layers) * hidden_size, hidden_size, bias=False) if self.aux_layers else None
        self.init_draft_vocab(config)

    num_heads = property(lambda self: self.config.medusa_num_heads)  # levels drafted, as many as heads elsewhere
    propose_after_verification = True  # it drafts from the accepted text's features, known after verification

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable) -> torch.Tensor:
        """Predicted features [..., T, H] of positions p+1 from the embeddings of tokens p+1 and the features of
        positions p [..., T, H], with RoPE tables cos/sin [T, D] of positions p. `attend(layer, query, key, value)`
        ([..., heads or kv_heads, T, D] each) is layer `layer`'s attention: causal over a sequence in training,
        over that layer's KV cache in decoding."""
        head_dim = self.fields["head_dim"]

        def split(x: torch.Tensor) -> torch.Tensor:  # [..., T, heads * D] -> [..., heads, T, D]
            return x.unflatten(-1, (-1, head_dim)).transpose(-2, -3)

        hidden = self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            normed = hidden if layer.input_layernorm is None else layer.input_layernorm(hidden)
            query = rotary(split(attn.q_proj(normed)), cos, sin)
            key = rotary(split(attn.k_proj(normed)), cos, sin)
            out = attend(index, query, key, split(attn.v_proj(normed)))
            hidden = hidden + attn.o_proj(out.transpose(-2, -3).flatten(-2))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def text_features(self, final: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """What the drafter reads for text the base model ran over: its final hidden states `final` [..., H] and,
        fused, `fuse` of the inputs of `aux_layers` (`aux` [..., A*H], as `base_hidden` returns them)."""
        if self.fuse is None:
            return final
        parts = aux.unflatten(-1, (len(self.aux_layers), -1)).float()
        normed = F.rms_norm(parts, (parts.shape[-1],), eps=self.fields["rms_norm_eps"]).flatten(-2)
        return final + self.fuse(normed.to(self.fuse.weight.dtype)).to(final.dtype)

    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """Nothing to copy: the drafter always projects through the base model's lm_head."""

    def project(self, states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(states.to(lm_head.weight.dtype))


def new_feature_drafter(base_model: nn.Module, levels: int = 5, base_name: str | None = None,
                        draft_vocab: list[int] | None = None, aux_layers: list[int] | None = None,
                        layers: int = 1) -> FeatureDrafter:
    """An untrained drafter of `layers` decoder layers for `base_model`, drafting `levels` levels (a start for
    training), proposing from `draft_vocab` (token ids) or the whole vocabulary, fusing the inputs of
    `aux_layers` (from zero) if given."""
    c = base_model.config
    config = MedusaConfig(levels, layers, "shared_lm_head", c.hidden_size, c.vocab_size, base_name, None, "features",
                          len(draft_vocab) if draft_vocab else None, medusa_feature_layer=feature_layer_fields(c),
                          medusa_feature_aux_layers=list(aux_layers) if aux_layers else None)
    drafter = FeatureDrafter(config, c.hidden_size, c.vocab_size)
    if draft_vocab:
        drafter.draft_vocab.copy_(torch.tensor(draft_vocab))
    if drafter.fuse is not None:
        nn.init.zeros_(drafter.fuse.weight)
    return drafter


def start_from(drafter: FeatureDrafter, initial: FeatureDrafter) -> None:
    """Load `initial`'s weights (not its draft vocabulary) into `drafter`, which may have more layers: those
    start as identities (their output projections zero), so `drafter` first drafts exactly as `initial`."""
    if len(drafter.layers) < len(initial.layers):
        raise MedusaLoadError(f"a drafter of {len(drafter.layers)} layers cannot start from one of "
                              f"{len(initial.layers)}")
    drafter.load_state_dict({k: v for k, v in initial.state_dict().items() if k != "draft_vocab"}, strict=False)
    for layer in drafter.layers[len(initial.layers):]:
        for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
            nn.init.zeros_(projection.weight)
            if projection.bias is not None:
                nn.init.zeros_(projection.bias)


def base_hidden(base_model: nn.Module, ids: torch.Tensor, aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The base model's final hidden states [B, L, H] over `ids` [B, L] and the inputs of `aux_layers`
    concatenated [B, L, A*H] (None without them): what a drafter's `text_features` reads, in training."""
    out = base_model.model(input_ids=ids, output_hidden_states=bool(aux_layers))
    if not aux_layers:
        return out.last_hidden_state, None
    return out.last_hidden_state, torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)
