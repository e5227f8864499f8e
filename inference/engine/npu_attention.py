"""Attention through Ascend's fused inference kernel, for the engine's forward on NPUs.

`torch_npu.npu_fused_infer_attention_score` runs single-token decoding and Medusa tree verification in one
kernel with GQA, in eager and in torchair's graph mode. Its mask is inverted relative to the engine's
(True = masked out). `torch_npu` is imported only when the kernel runs, so nothing here needs it elsewhere.
`attention_for` picks each device's attention, this kernel's or SDPA's.
"""

from collections.abc import Callable

import torch

from inference.engine.cpu_linear import amx_cpu
from inference.engine.forward import float32_attention, masked_attention


def npu_fused_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """query [H, T, D], keys/values [KV, C, D], visible [T, C] -> [H, T, D], like `masked_attention`."""
    import torch_npu

    output, _ = torch_npu.npu_fused_infer_attention_score(
        query.unsqueeze(0).contiguous(), keys.unsqueeze(0), values.unsqueeze(0),  # BNSD, contiguous
        atten_mask=(~visible).view(1, 1, *visible.shape),
        num_heads=query.shape[0],
        num_key_value_heads=keys.shape[0],
        input_layout="BNSD",
        scale=scale,
        sparse_mode=0,
    )
    return output[0]


def attention_for(device: torch.device, dtype: torch.dtype) -> Callable:
    """The masked attention a step on `device` in `dtype` runs: the fused kernel on Ascend; SDPA elsewhere, in
    float32 for a bf16 step on a CPU without AMX, where ATen's bf16 flash kernel is the slow one (an AMX Xeon's
    was not; docs/engine.md)."""
    if device.type == "npu":
        return npu_fused_attention
    if device.type == "cpu" and dtype is torch.bfloat16 and not amx_cpu():
        return float32_attention
    return masked_attention
