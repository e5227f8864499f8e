"""bf16 linear layers on CPUs with native bf16, through weights reordered once for oneDNN.

A bf16 `F.linear` on the CPU hands the weight to oneDNN in PyTorch's layout, and oneDNN reorders it into
its blocked layout on every call, so each decoding step reads every weight about twice. Reordering each
weight once, at its first bf16 forward without autograd, and calling oneDNN's linear on that copy gives
the same results (bit-identical on the shapes tested here) 1.3-2x faster: on a 2-core Xeon with AMX,
576x576 / 1536x576 / 49152x576 bf16 linears timed one by one took 80 / 160 / 4400 us for one token
through `F.linear` against 40 / 76 / 2000 us packed (the README has what that did end to end). Where the
CPU has no native bf16 (AVX2 only), nothing changes.

The packed copy costs the weight's memory once more, so a weight is only packed while a quarter of the
host memory stays free (a 7B model's bf16 weights on a small CPU machine keep `F.linear` for the rest).
Everything else (fp32, fp16, another device, training with autograd) goes through `F.linear` as before, and
so does a captured graph, where inductor's freezing packs the weights itself.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from inference.engine.host_memory import free_host_memory, total_host_memory

# oneDNN picks its weight layout for this many rows of input; 64 was as fast as or faster than 1 and 13
# for both one token and a 13-token tree step on the shapes above.
PACKING_BATCH_HINT = 64

# module -> (the weight's identity when packed, its packed copy or None when it was left unpacked, the weight
# packed: held so that its memory cannot be handed to a replacement weight, whose identity would then match)
_packed: "weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, torch.Tensor | None, torch.Tensor]]" = \
    weakref.WeakKeyDictionary()


def native_bf16_cpu() -> bool:
    """Whether this CPU has bf16 matrix kernels (AVX512-BF16 / AMX); without them a k-token bf16
    forward costs about k times one token."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def amx_cpu() -> bool:
    """Whether this CPU has AMX tiles: there inductor's bf16 GEMMs and ATen's bf16 flash attention are fast, where
    on a CPU with AVX512-BF16 alone both are slower than their alternatives (docs/engine.md)."""
    return torch.cpu._is_amx_tile_supported()


def packing_supported() -> bool:
    """Whether oneDNN can run bf16 linears on packed weights here: without native bf16 it gains nothing."""
    return torch.backends.mkldnn.is_available() and native_bf16_cpu()


def _fits(weight: torch.Tensor) -> bool:
    """Whether packing `weight` leaves at least a quarter of the host memory free."""
    return free_host_memory() - weight.numel() * weight.element_size() > total_host_memory() // 4


def _packed_weight(linear: nn.Linear) -> torch.Tensor | None:
    """The packed copy of the current weight (packed now if it changed or was never packed), or None."""
    weight = linear.weight
    # (inference tensors, such as a draft-vocabulary projection cut during decoding, keep no version count)
    identity = (weight.data_ptr(), None if weight.is_inference() else weight._version, weight.shape)
    entry = _packed.get(linear)
    if entry is None or entry[0] != identity:
        _packed.pop(linear, None)  # a stale copy is freed before packing anew
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT) if _fits(weight) else None
        entry = _packed[linear] = (identity, packed, weight.detach())
    return entry[1]


class PackedBf16Linear(nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) whose bf16 CPU inference runs on a packed weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype is torch.bfloat16 and self.weight.dtype is torch.bfloat16 and x.device.type == "cpu"
                and x.dim() >= 2 and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
            packed = _packed_weight(self)
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def use_packed_bf16_linears(module: nn.Module) -> nn.Module:
    """Make every `nn.Linear` in `module` a `PackedBf16Linear` (in place) where this CPU has bf16 kernels.
    Weights are packed lazily, so this costs nothing until a bf16 forward runs; copies and dtype changes
    of the module stay correct (a copy packs its own weights, an fp32 one uses `F.linear`)."""
    if packing_supported():
        for child in module.modules():
            if type(child) is nn.Linear:
                child.__class__ = PackedBf16Linear
    return module
