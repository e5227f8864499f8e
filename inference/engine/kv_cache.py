"""A preallocated KV cache that plugs into the stock transformers forward.

All layers' keys and values live in one tensor allocated once, so a decoding step allocates nothing,
attention only reads the valid prefix (views, not the full capacity), and keeping an accepted tree path
is one gather-and-copy for all layers together.
"""

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin


class _LayerView(CacheLayerMixin):
    """One layer's slice of the shared buffer; sizes come from the owning KVBuffer."""

    is_sliding = False

    def __init__(self, owner: "KVBuffer", keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner, self.keys, self.values, self.is_initialized = owner, keys, values, True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("KVBuffer.update writes all layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity


class KVBuffer(Cache):
    """Batch-1 KV cache of fixed `capacity`; `length` tokens are valid.

    A forward of n tokens appends them (the length advances after the last layer); `keep(...)` then
    retains only an accepted subset of the tokens just appended.
    """

    def __init__(self, config: PretrainedConfig, capacity: int, device: torch.device, dtype: torch.dtype):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.capacity = capacity
        self.length = 0
        # [layer, key/value, batch=1, kv_heads, capacity, head_dim]
        self.data = torch.zeros(
            (self.num_layers, 2, 1, config.num_key_value_heads, capacity, head_dim), device=device, dtype=dtype
        )
        super().__init__(layers=[_LayerView(self, self.data[i, 0], self.data[i, 1]) for i in range(self.num_layers)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens > capacity {self.capacity}")
        keys, values = self.data[layer_idx, 0], self.data[layer_idx, 1]
        keys[:, :, self.length : end] = key_states
        values[:, :, self.length : end] = value_states
        if layer_idx == self.num_layers - 1:
            self.length = end
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0

    def keep(self, start: int, offsets: torch.Tensor, count: int) -> None:
        """Keep, at positions start.., the first `count` of the appended tokens at start + offsets; drop the rest.

        `offsets` is a device tensor of fixed length (the accepted tree path, padded with any valid offset), so
        the copy has the same shape every step and needs no host round trip; only `count` comes from the host.
        """
        width = offsets.shape[0]
        self.data[:, :, :, :, start : start + width] = self.data.index_select(4, offsets + start)
        self.length = start + count
