"""Capturing a decoding step as one static graph: inductor on CPUs, CUDA graphs on GPUs, torchair on Ascend.

A step runs dozens of small kernels per layer; eager PyTorch pays a dispatch for each, which for a small
model (or an accelerator with a launch cost) is most of the step. Captured with `fullgraph=True` (a graph
break is an error, not a silent slowdown) and `dynamic=False` over inputs whose shapes never change, one
graph serves every step of a generation and every generation of the same tree and cache capacity.
"""

import time
import types
import warnings
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

from inference.engine.cpu_linear import amx_cpu, native_bf16_cpu
from inference.engine.decoding import DecodeStats

# Graphs this process may hold per step function: plain and Medusa steps over a few capacities, trees and
# sampling rules (dynamo's default of 8 would fall back to eager without a word).
RECOMPILE_LIMIT = 64
# How inductor compiles a CPU step (`capture` says why); the GEMM timings are not printed.
CPU_GRAPH_OPTIONS = {"freezing": True, "cpp.enable_concat_linear": True, "cpp_wrapper": True,
                     "max_autotune_gemm": True, "max_autotune_gemm_backends": "CPP,ATEN",
                     "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


def cpu_graph_options(dtype: torch.dtype) -> dict:
    """How inductor compiles a CPU step in `dtype`. A bf16 step on a CPU with AVX512-BF16 but no AMX takes
    oneDNN's GEMMs only: there inductor's own bf16 GEMM widens every weight to float32 in its inner loop and
    read the demo model's weights at 19 GB/s in a step, oneDNN's at 29, yet autotuning, which times each GEMM
    alone, chose inductor's (a plain step 20 ms against 14-15; docs/performance.md). With AMX, inductor's
    kernel uses the tiles; without native bf16 (AVX2), oneDNN's bf16 tree step fell to 663 ms."""
    if dtype is torch.bfloat16 and native_bf16_cpu() and not amx_cpu():
        return {**CPU_GRAPH_OPTIONS, "max_autotune_gemm_backends": "ATEN"}
    return CPU_GRAPH_OPTIONS


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


def own_code(step: Callable) -> Callable:
    """`step` (a function or bound method) with a code object of its own. Dynamo keeps compiled graphs and
    their guards per code object, so two decoders would otherwise share one cache: each one's guards would
    run on the other's arguments (a fixed-tree drafter's attributes looked up on a dynamic one) and count
    against one recompile limit."""
    function = getattr(step, "__func__", step)
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return types.MethodType(copy, step.__self__) if hasattr(step, "__self__") else copy


def capture(step: Callable, device: torch.device, dtype: torch.dtype) -> Callable:
    """`step` compiled into one static graph for `device`'s backend, its weights in `dtype`."""
    step = own_code(step)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * RECOMPILE_LIMIT)
    if device.type == "cpu":
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        options = cpu_graph_options(dtype)
        # the GEMM timing's own deprecation warning, once per compile; set here, not around every step
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", module=r"torch\._inductor\.select_algorithm")

        def frozen(*args):
            # freezing folds the weights into the graph and prepacks them (bf16 on AMX/AVX512-BF16); linears that
            # read one input (q/k/v, gate/up) are concatenated; and each GEMM shape is timed as inductor's own C++
            # kernel against oneDNN's, keeping the faster: a oneDNN call costs ~40 us beyond reading its weights,
            # a quarter of the demo model's step on an AMX Xeon. The graph's kernels are called from C++, not
            # from generated Python (a wrapper call per kernel and per buffer: on a 2-core AMD EPYC 5% of the
            # demo model's captured plain and Medusa steps, for ~30 s more compiling). Inductor reads these when it
            # compiles, which happens inside a call (passed as `options` they are not seen).
            with torch._inductor.config.patch(options):
                return compiled(*args)

        return frozen
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


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


class CapturedStep:
    """A step function run captured or eager. A call that compiles (the first of each new shape, or any call
    whose guards fail) says so (`log`) and adds its seconds to the request's `compile_seconds`, which rates
    leave out; so a recompile is never hidden in the decoding speed."""

    def __init__(self, step: Callable, device: torch.device, dtype: torch.dtype, captured: bool, name: str,
                 log: Callable[[str], None] | None = None):
        self.name, self.captured, self.log = name, captured, log
        self.run = capture(step, device, dtype) if captured else step
        self.compiled: set[tuple] = set()

    def __call__(self, key: tuple, label: str, stats: DecodeStats, *args):
        """`key`: what the graph depends on; `label`: how the log names it."""
        if not self.captured:
            return self.run(*args)
        expected = key not in self.compiled
        if expected and self.log:
            self.log(f"Compiling the {self.name} step ({label}); once per shape and process (1-2 min on 2 CPU cores) ...")
        graphs, started = graphs_compiled(), time.perf_counter()
        result = self.run(*args)
        if graphs_compiled() > graphs:
            seconds = time.perf_counter() - started
            stats.compile_seconds += seconds
            if self.log:
                self.log(f"{'Compiled' if expected else 'Recompiled'} the {self.name} step ({label}) in {seconds:.1f} s")
        self.compiled.add(key)
        return result
