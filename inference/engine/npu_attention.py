"""Attention through Ascend's fused inference kernel, plugged into transformers' attention interface.

`torch_npu.npu_fused_infer_attention_score` runs prefill, single-token decoding and Medusa tree
verification in one kernel with GQA. Its mask is inverted relative to transformers' bool masks
(True = masked out), so masks are converted here; float additive masks are accepted too.
"""

import torch

NPU_ATTENTION = "npu_fused"


def npu_fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, H, S, D], key/value [B, KV, L, D] (BNSD) -> ([B, S, H, D], None) like transformers' kernels."""
    import torch_npu

    mask = None
    if attention_mask is not None:
        hidden = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
        mask = hidden[..., : key.shape[-2]].contiguous()
    output, _ = torch_npu.npu_fused_infer_attention_score(
        query.contiguous(), key.contiguous(), value.contiguous(),  # the kernel takes contiguous inputs only
        atten_mask=mask,
        num_heads=query.shape[1],
        num_key_value_heads=key.shape[1],
        input_layout="BNSD",
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        sparse_mode=0,
    )
    return output.transpose(1, 2).contiguous(), None


def npu_mask(*args, **kwargs):
    """SDPA's bool mask, but never skipped: SDPA may drop a causal mask for `is_causal`, the kernel cannot."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_npu_attention() -> None:
    """Make `attn_implementation="npu_fused"` available."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NPU_ATTENTION, npu_fused_attention)
    AttentionMaskInterface.register(NPU_ATTENTION, npu_mask)


def use_npu_attention(model) -> None:
    register_npu_attention()
    model.set_attn_implementation(NPU_ATTENTION)
