"""bf16 linears on packed oneDNN weights: same results as F.linear, used only where they can be."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.engine import cpu_linear, host_memory
from inference.engine.cpu_linear import PackedBf16Linear, use_packed_bf16_linears

needs_bf16_kernels = pytest.mark.skipif(not cpu_linear.packing_supported(),
                                        reason="this CPU has no oneDNN bf16 kernels (AVX2 only): nothing is packed")


def packed_calls(run) -> int:
    """How often `run()` called oneDNN's linear on a packed weight."""
    with torch.profiler.profile() as prof:
        run()
    return sum(event.count for event in prof.key_averages() if event.key == "mkldnn::_linear_pointwise")


def bf16_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)


def reference(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, mlp[0].weight, mlp[0].bias)), mlp[2].weight)


def assert_matches_f_linear(mlp: nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode():
        # bit-identical where measured; a 0.5% error (one bf16 step or more) fails
        torch.testing.assert_close(mlp(x), reference(mlp, x), atol=1e-3, rtol=1e-3)


def packed_after_one_forward() -> tuple[nn.Module, torch.Tensor]:
    """A bf16 MLP whose weights were packed by one inference forward, and its input."""
    mlp = use_packed_bf16_linears(bf16_mlp())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert packed_calls(lambda: mlp(x)) == 2
    return mlp, x


@needs_bf16_kernels
def test_bf16_inference_runs_on_packed_weights_with_the_results_of_f_linear():
    mlp = use_packed_bf16_linears(bf16_mlp())
    assert all(isinstance(layer, PackedBf16Linear) for layer in (mlp[0], mlp[2]))
    for shape in ((1, 64), (13, 64), (1, 5, 64)):
        x = torch.randn(shape, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert packed_calls(lambda: mlp(x)) == 2
        assert_matches_f_linear(mlp, x)
    assert_matches_f_linear(mlp, torch.randn(8, 64, dtype=torch.bfloat16)[::2])  # a non-contiguous input


@needs_bf16_kernels
def test_fp32_and_autograd_forwards_stay_on_f_linear():
    mlp = use_packed_bf16_linears(bf16_mlp())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert packed_calls(lambda: mlp(x).sum().backward()) == 0  # grad mode: training keeps autograd
    assert mlp[0].weight.grad is not None
    mlp32 = mlp.float()
    x32 = x.float()
    with torch.inference_mode():
        assert packed_calls(lambda: mlp32(x32)) == 0
        torch.testing.assert_close(mlp32(x32), reference(mlp32, x32))


@needs_bf16_kernels
def test_a_weight_changed_after_packing_is_packed_again():
    mlp, x = packed_after_one_forward()
    with torch.no_grad():
        mlp[0].weight.mul_(-2)  # in place: the same storage, a new version
    assert_matches_f_linear(mlp, x)
    mlp.float().to(torch.bfloat16)  # new storage of equal values
    mlp[2].weight.data = torch.randn_like(mlp[2].weight)
    assert_matches_f_linear(mlp, x)


@needs_bf16_kernels
def test_a_copy_of_a_packed_module_packs_its_own_weights():
    mlp, x = packed_after_one_forward()
    twin = copy.deepcopy(mlp)
    with torch.no_grad():
        twin[0].weight.zero_()
    assert_matches_f_linear(twin, x)
    assert_matches_f_linear(mlp, x)
    assert mlp.state_dict().keys() == bf16_mlp().state_dict().keys()


@needs_bf16_kernels
def test_weights_stay_unpacked_when_packing_would_leave_too_little_memory(monkeypatch):
    monkeypatch.setattr(cpu_linear, "free_host_memory", lambda: cpu_linear.total_host_memory() // 4)
    mlp = use_packed_bf16_linears(bf16_mlp())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert packed_calls(lambda: mlp(x)) == 0
        torch.testing.assert_close(mlp(x), reference(mlp, x))


def test_free_host_memory_counts_the_page_cache_the_kernel_gives_back(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          500000 kB\nMemAvailable:   20000000 kB\n")
    assert host_memory.free_host_memory(str(meminfo)) == 20000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          500000 kB\n")  # no MemAvailable: unused pages
    unused = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(host_memory.free_host_memory(str(meminfo)) - unused) < 256 * 2**20
    assert abs(host_memory.free_host_memory(str(tmp_path / "missing")) - unused) < 256 * 2**20


def test_cpus_without_bf16_kernels_keep_their_linears(monkeypatch):
    monkeypatch.setattr(cpu_linear, "packing_supported", lambda: False)
    mlp = use_packed_bf16_linears(bf16_mlp())
    assert type(mlp[0]) is nn.Linear and type(mlp[2]) is nn.Linear


@needs_bf16_kernels
def test_a_bf16_cpu_model_and_its_heads_decode_on_packed_weights(tiny_pangu):
    from inference.engine.decoding import DecodeRequest
    from inference.runtime.loading import load_causal_lm
    from inference.engine.medusa_decoding import MedusaDecoder
    from medusa_choices import DynamicTree
    from medusa_helpers import random_heads

    model = load_causal_lm(tiny_pangu[0], torch.device("cpu"), torch.bfloat16)
    heads = random_heads(model, num_heads=2, head_input="hidden_and_path").to(torch.bfloat16)
    decoder = MedusaDecoder(model, heads)
    assert isinstance(model.lm_head, PackedBf16Linear) and isinstance(heads[0][0], PackedBf16Linear)
    calls = packed_calls(lambda: list(decoder.decode(DecodeRequest([1, 2, 3], 4), DynamicTree(4))))
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert calls > 2 * linears  # the prefill, the verification steps and the heads' drafting
