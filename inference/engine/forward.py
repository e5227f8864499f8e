"""The base model's forward over a static KV cache: the one forward every decoding step runs, eager or captured.

Every shape is fixed by the cache's capacity and the step's token count, and whatever changes from step to
step (how many tokens are cached, where the new ones go, which of them may see which) arrives as a device
tensor, so one captured graph serves every step. Attention reads the whole cache with a mask that hides the
unwritten part: over a few hundred keys that costs less than a kernel launch per valid length would.

The layers are the model's own modules (norms, projections, MLP), called in Llama's order: this forward
serves the Llama family, OpenPangu-Embedded included (biases on q/k/v/o, GQA).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from inference.engine.graph_mode import keep_addresses

# Capacities are rounded up to one of these (then to multiples of the largest), so prompts of different
# lengths share one captured graph.
CAPACITY_BUCKETS = (256, 512, 1024, 2048, 4096)

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp")


def capacity_bucket(tokens: int) -> int:
    """The cache capacity for `tokens` tokens: the smallest bucket that holds them."""
    for bucket in CAPACITY_BUCKETS:
        if tokens <= bucket:
            return bucket
    largest = CAPACITY_BUCKETS[-1]
    return -(-tokens // largest) * largest


def check_supported(model: nn.Module) -> None:
    """Raise ValueError unless `model` is a Llama-family decoder this forward computes exactly."""
    config = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model.model, "rotary_emb") or not hasattr(model.model, "norm"):
        raise ValueError(f"{type(model).__name__} is not a Llama-family decoder (model.layers, rotary_emb, norm)")
    for part in _LAYER_PARTS:
        if not all(_has(layer, part) for layer in layers):
            raise ValueError(f"{type(model).__name__} layers lack {part}: not a Llama-family decoder")
    if _has(layers[0], "self_attn.q_norm") or getattr(config, "sliding_window", None):
        raise ValueError(f"{type(model).__name__} (q/k norms or sliding windows) is not computed by this engine")
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}).get("rope_type")
    if rope == "dynamic":
        raise ValueError("dynamic RoPE scaling depends on the sequence length: not supported by this engine")


def _has(module: nn.Module, dotted: str) -> bool:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


@dataclass(frozen=True, eq=False)
class StaticCache:
    """Keys and values of every layer [kv_heads, capacity, head_dim] and the RoPE tables [capacity, head_dim]."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def keep(self, start: torch.Tensor, nodes: torch.Tensor) -> None:
        """Move the entries of the just-verified tree's `nodes` [W] (node ids, root first) to the slots start..,
        so the accepted path follows the text before it. Fixed width W, device tensors only: no host read."""
        sources = start + nodes
        targets = start + torch.arange(nodes.shape[0], device=nodes.device)
        for tensor in self.keys + self.values:
            tensor[:, targets] = tensor[:, sources]


def new_cache(model: nn.Module, capacity: int, dtype: torch.dtype | None = None) -> StaticCache:
    """An empty cache of `capacity` slots holding keys and values in `dtype` (default: the model's)."""
    config, weight = model.config, model.lm_head.weight
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shape = (config.num_key_value_heads, capacity, head_dim)

    def zeros():
        return torch.zeros(shape, device=weight.device, dtype=dtype or weight.dtype)

    positions = torch.arange(capacity, device=weight.device).unsqueeze(0)
    cos, sin = model.model.rotary_emb(torch.zeros(shape, device=weight.device, dtype=weight.dtype), positions)
    layers = range(config.num_hidden_layers)
    return StaticCache(tuple(zeros() for _ in layers), tuple(zeros() for _ in layers), cos[0], sin[0])


class CacheSlot:
    """The cache of the latest capacity, kept between requests: a captured graph reads it at a fixed address."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype, self.cache = model, dtype, None

    def get(self, tokens: int) -> StaticCache:
        capacity = capacity_bucket(tokens)
        if self.cache is None or self.cache.capacity != capacity:
            self.cache = None  # freed before the next one is allocated
            self.cache = new_cache(self.model, capacity, self.dtype)
            keep_addresses(*self.cache.keys, *self.cache.values)
        return self.cache


class BaseStates(NamedTuple):
    """A forward's final hidden states `hidden` [T, H] and the inputs of the layers it was asked for, concatenated
    `aux` [T, A*H] (None when none were): what a fused feature drafter reads of the text."""

    hidden: torch.Tensor
    aux: torch.Tensor | None


def prefill(model: nn.Module, cache: StaticCache, prompt: list[int], aux_layers: tuple[int, ...] = ()) -> BaseStates:
    """The prompt into an empty cache; the states of its positions."""
    ids = torch.tensor(prompt, device=model.device)
    positions = torch.arange(len(prompt), device=model.device)
    return forward(model, cache, ids, positions, positions, None, aux_layers=aux_layers)


def visible_mask(tree_mask: torch.Tensor, start: torch.Tensor, capacity: int) -> torch.Tensor:
    """[T, capacity] bool: each of the T new tokens (written at slots start..start+T-1) sees every cached slot
    before `start` and, among the new ones, those `tree_mask` [T, T] allows."""
    size = tree_mask.shape[0]
    relative = torch.arange(capacity, device=tree_mask.device) - start  # [capacity]
    in_step = (relative >= 0) & (relative < size)
    among_new = tree_mask.gather(1, relative.clamp(0, size - 1).expand(size, capacity))
    return (relative < 0) | (in_step & among_new)


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """GQA attention of query [H, T, D] over the whole cache keys/values [KV, C, D], `visible` [T, C].

    SDPA with the boolean mask and `enable_gqa` (no KV head is repeated): on a CPU its flash kernel, which
    keeps the softmax in float32, costs a third of the explicit product and float softmax at one token and
    about half at 13, eager or captured (docs/engine.md)."""
    return F.scaled_dot_product_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                          attn_mask=visible, scale=scale, enable_gqa=True)[0]


def float32_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """`masked_attention` of 16-bit queries computed in float32 over a float32 cache (`cache_dtype`), for CPUs where
    ATen's bf16 flash kernel is the slow one (docs/engine.md)."""
    return masked_attention(query.float(), keys.float(), values.float(), visible, scale).to(query.dtype)


def cache_dtype(attention, dtype: torch.dtype) -> torch.dtype:
    """The dtype a step in `dtype` keeps its keys and values in: float32 where `attention` computes in float32, so
    each key is widened once, when written (exactly: 16-bit floats are float32 values), rather than the whole cache
    at every layer of every step."""
    return torch.float32 if attention is float32_attention else dtype


def prompt_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prompt over its own keys (the cache was empty): SDPA's memory-efficient kernel."""
    return F.scaled_dot_product_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                          is_causal=True, scale=scale, enable_gqa=True)[0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [heads, T, D] at the positions whose tables are cos/sin [T, D]."""
    return x * cos + _rotate_half(x) * sin


def forward(model: nn.Module, cache: StaticCache, tokens: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, visible: torch.Tensor | None, attention=masked_attention,
            aux_layers: tuple[int, ...] = ()) -> BaseStates:
    """The states of `tokens` [T] at RoPE `positions` [T] (with the inputs of `aux_layers`), their keys and values
    written to cache `slots` [T]. `visible` [T, capacity] says which slots each token attends to; None: a prompt
    on an empty cache (slots 0..T-1), causal over itself. `attention` computes the masked case (a device's kernel)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = cache.keys[0].shape[-1]
    scale = head_dim ** -0.5
    size = tokens.shape[0]
    cos, sin = cache.cos[positions], cache.sin[positions]
    hidden = model.model.embed_tokens(tokens)
    aux = []
    for index, (layer, keys, values) in enumerate(zip(model.model.layers, cache.keys, cache.values)):
        if index in aux_layers:
            aux.append(hidden)
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(size, heads, head_dim).transpose(0, 1)
        key = attn.k_proj(x).view(size, kv_heads, head_dim).transpose(0, 1)
        query, key = rotary(query, cos, sin), rotary(key, cos, sin)
        value = attn.v_proj(x).view(size, kv_heads, head_dim).transpose(0, 1)
        keys[:, slots] = key.to(keys.dtype)
        values[:, slots] = value.to(values.dtype)
        if visible is None:  # the prompt: its own keys are the cache's first `size` slots
            out = prompt_attention(query, key, value, scale)
        else:
            out = attention(query, keys, values, visible, scale)
        hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(size, heads * head_dim))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return BaseStates(model.model.norm(hidden), torch.cat(aux, dim=-1) if aux else None)
