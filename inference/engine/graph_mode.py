"""Capturing a decoding step as one static graph: inductor on CPUs, CUDA graphs on GPUs, torchair on Ascend.

A step runs dozens of small kernels per layer; eager PyTorch pays a dispatch for each, which for a small
model (or an accelerator with a launch cost) is most of the step. Captured with `fullgraph=True` (a graph
break is an error, not a silent slowdown) and `dynamic=False` over inputs whose shapes never change, one
graph serves every step of a generation and every generation of the same tree and cache capacity.
"""

import time
from collections.abc import Callable

import torch

# Graphs this process may hold per step function: plain and Medusa steps over a few capacities, trees and
# sampling rules (dynamo's default of 8 would fall back to eager without a word).
RECOMPILE_LIMIT = 64


def npu_backend():
    """torchair's graph backend for Ascend (GE graph with static shapes), imported only when asked for."""
    try:
        import torchair
        from torchair.configs.compiler_config import CompilerConfig
    except ImportError:
        raise ValueError("graph mode on Ascend needs torchair (shipped with torch_npu 2.1+); "
                         "install it, or run with --compile off") from None
    config = CompilerConfig()
    config.experimental_config.frozen_parameter = True  # weights do not change while decoding
    return torchair.get_npu_backend(compiler_config=config)


def capture(step: Callable, device: torch.device) -> Callable:
    """`step` compiled into one static graph for `device`'s backend."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * RECOMPILE_LIMIT)
    if device.type == "cpu":
        # freezing folds the weights into the graph and lets oneDNN prepack them (bf16 on AMX/AVX512-BF16)
        return torch.compile(step, fullgraph=True, dynamic=False, options={"freezing": True})
    if device.type == "cuda":
        return torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")  # CUDA graphs
    if device.type == "npu":
        return torch.compile(step, fullgraph=True, dynamic=False, backend=npu_backend())
    raise ValueError(f"graph mode is not available on {device.type} (use --compile off)")


def keep_addresses(*tensors: torch.Tensor) -> None:
    """Tell the CUDA-graph backend that these step inputs (the KV cache) live at fixed addresses and may be
    written in place by the graph, instead of copying them in and out at every replay."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            torch._dynamo.mark_static_address(tensor)


class CapturedStep:
    """A step function run captured or eager; the first call of each new shape says it compiles and how long
    it took (the compiled code is cached on disk, see inference/runtime/home.py, so later processes start faster)."""

    def __init__(self, step: Callable, device: torch.device, captured: bool, name: str,
                 log: Callable[[str], None] | None = None):
        self.name, self.captured, self.log = name, captured, log
        self.run = capture(step, device) if captured else step
        self.compiled: dict[tuple, float] = {}  # shape key -> seconds its compilation took

    def __call__(self, key: tuple, *args):
        if not self.captured or key in self.compiled:
            return self.run(*args)
        if self.log:
            self.log(f"Compiling the {self.name} step {key} (once per shape; cached on disk for later runs)...")
        started = time.perf_counter()
        result = self.run(*args)
        self.compiled[key] = time.perf_counter() - started
        if self.log:
            self.log(f"Compiled the {self.name} step in {self.compiled[key]:.1f} s")
        return result

    @property
    def compile_seconds(self) -> float:
        return sum(self.compiled.values())
