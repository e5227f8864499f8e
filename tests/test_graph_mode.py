"""Captured steps: one graph per step function and shape, nothing recompiled while decoding, the same tokens as
eager decoding, sampling still lossless, and no hidden synchronisation inside."""

import os
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from inference.engine import graph_mode
from inference.engine.graph_mode import graphs_compiled
from inference.engine.decoding import DecodeRequest, DecodeStats
from inference.engine.feature_drafting import FeatureTreeDrafter
from inference.engine.medusa_decoding import Acceptance, MedusaDecoder
from inference.engine.plain_decoding import PlainDecoder
from inference.engine.step_schedule import AdaptiveSchedule, StepOption
from medusa_choices import DynamicTree, load_tree
from medusa_helpers import TEST_DEVICE, hf_greedy, random_heads, random_prompts
from test_hidden_syncs import hidden_syncs_after_prefill
from test_medusa_sampling import (LENGTH, PROMPT, SAMPLING, chi_square_rejects, exact_distribution,
                                  tiny_vocab_model)

# (heads, tree, whether these random heads get candidates accepted on the test's prompts)
CASES = [("hidden", "mc_sim_7b_63", True), ("hidden_and_next_token", "tree_16", False),
         ("hidden_and_path", "dynamic:16", True), ("hidden_and_path", "dynamic:16:lookup=0", False),
         ("features", "dynamic:16", True)]


def ids(steps) -> list[int]:
    return [t for step in steps for t in step]


@pytest.fixture(scope="module")
def prompts(pangu_on_device):
    # repeated text, so that context lookup guesses
    return [p * 3 for p in random_prompts(pangu_on_device.config.vocab_size, count=2, seed=5)]


def test_a_captured_plain_decode_equals_hf_greedy_and_recompiles_nothing_after_warm_up(pangu_on_device, prompts):
    model = pangu_on_device
    decoder = PlainDecoder(model, compile=True)
    stats, first = DecodeStats(), graphs_compiled()
    assert ids(decoder.decode(DecodeRequest(prompts[0], 8), stats)) == hf_greedy(model, prompts[0], 8)
    assert stats.compile_seconds > 0 and graphs_compiled() == first + 1
    before, stats = graphs_compiled(), DecodeStats()
    assert ids(decoder.decode(DecodeRequest(prompts[1], 128), stats)) == hf_greedy(model, prompts[1], 128)
    assert graphs_compiled() == before and stats.compile_seconds == 0


@pytest.mark.parametrize("head_input,tree,accepts", CASES)
def test_captured_medusa_steps_give_the_eager_tokens_and_recompile_nothing_over_128_tokens(
        pangu_on_device, prompts, head_input, tree, accepts):
    model = pangu_on_device
    heads = random_heads(model, head_input=head_input, std=0.3)
    eager, captured = MedusaDecoder(model, heads), MedusaDecoder(model, heads, compile=True)
    warm, first = DecodeStats(), graphs_compiled()
    expected = hf_greedy(model, prompts[0], 16)
    assert ids(captured.decode(DecodeRequest(prompts[0], 16), load_tree(tree), stats=warm)) == expected
    assert warm.compile_seconds > 0 and graphs_compiled() == first + 1  # one graph serves the first step and the rest
    before, stats, eager_stats = graphs_compiled(), DecodeStats(), DecodeStats()
    request = DecodeRequest(prompts[1], 128)
    out = ids(captured.decode(request, load_tree(tree), stats=stats))
    assert out == ids(eager.decode(request, load_tree(tree), stats=eager_stats)) == hf_greedy(model, prompts[1], 128)
    assert graphs_compiled() == before and stats.compile_seconds == 0
    assert stats.accept_lengths == eager_stats.accept_lengths and (stats.tokens_per_step > 1) == accepts


class PlainThirdAndFourthSteps(AdaptiveSchedule):
    """A schedule of tree steps but the third and fourth, which are plain."""

    def __init__(self, tree):
        super().__init__([StepOption(tree, 2.0, 1.0), StepOption(None, 1.0, 1.0)], costs_realised=True)
        self.steps = 0

    def _choose(self, stats, expected):
        self.steps += 1
        return 1 if self.steps in (3, 4) else 0


@pytest.mark.parametrize("head_input,tree", [("hidden", "mc_sim_7b_63"), ("features", "dynamic:16")])
def test_a_schedules_plain_step_compiles_before_the_answer_starts_and_changes_no_token_or_draft(
        pangu_on_device, prompts, head_input, tree, monkeypatch):
    model = pangu_on_device
    drafted_from = []  # the feature drafter's state wherever a tree step drafts from it (after the prompt, a plain step)
    carried = FeatureTreeDrafter.carried

    def recording(drafter, carry):
        drafted_from.append(drafter.cache.state.clone())
        return carried(drafter, carry)

    monkeypatch.setattr(FeatureTreeDrafter, "carried", recording)
    heads = random_heads(model, head_input=head_input, std=0.3)
    captured, eager = MedusaDecoder(model, heads, compile=True), MedusaDecoder(model, heads)
    request, stats, steps = DecodeRequest(prompts[0], 32), DecodeStats(), []
    for step in captured.decode(request, PlainThirdAndFourthSteps(load_tree(tree)), stats=stats):
        steps.append(step)
        if len(steps) == 2:  # the prefill's token, then the first step's: every graph is compiled by now
            compiled = graphs_compiled()
    assert stats.step_sizes[1] == 2 and graphs_compiled() == compiled
    captured_states, drafted_from[:] = drafted_from[:], []
    assert steps == list(eager.decode(request, PlainThirdAndFourthSteps(load_tree(tree))))
    assert ids(steps) == hf_greedy(model, prompts[0], 32)
    assert len(captured_states) == len(drafted_from) == (2 if head_input == "features" else 0)
    for state, eager_state in zip(captured_states, drafted_from):  # the compiling plain step left no trace
        torch.testing.assert_close(state, eager_state, atol=1e-3, rtol=1e-3)  # captured against eager arithmetic


def test_captured_sampling_is_distributed_as_plain_sampling():
    model = tiny_vocab_model().to(TEST_DEVICE)
    expected = exact_distribution(model)
    decoder = MedusaDecoder(model, random_heads(model, num_heads=2, std=0.5, head_input="hidden_and_path"),
                            compile=True)
    tree, samples = DynamicTree(nodes=3, top_k=2, expand=1, lookup=3), 1500
    counts, stats = Counter(), DecodeStats()
    for seed in range(samples):
        request = DecodeRequest(PROMPT, LENGTH, (), SAMPLING, seed=seed)
        counts[tuple(ids(decoder.decode(request, tree, Acceptance("sample"), stats)))] += 1
    assert stats.accept_lengths[2] > samples // 10
    stat, critical = chi_square_rejects(counts, expected, samples)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: captured Medusa sampling is not lossless"


def test_captured_steps_make_no_hidden_sync(pangu_on_device, prompts):
    model = pangu_on_device
    plain = PlainDecoder(model, compile=True)
    medusa = MedusaDecoder(model, random_heads(model, head_input="hidden_and_path", std=0.3), compile=True)
    tree = load_tree("dynamic:16")
    for decode in (lambda n: plain.decode(DecodeRequest(prompts[0], n)),
                   lambda n: medusa.decode(DecodeRequest(prompts[0], n), tree)):
        ids(decode(8))  # compiles
        syncs, steps = hidden_syncs_after_prefill(decode(40))
        assert steps > 5 and syncs == 0


def test_a_graph_break_in_a_step_is_an_error_not_a_silent_eager_fallback():
    def step(x):
        torch._dynamo.graph_break()  # what any untraceable code in a step would cause
        return x + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        graph_mode.capture(step, torch.device("cpu"), torch.float32)(torch.ones(2))


@pytest.mark.parametrize("native_bf16, amx, dtype, backends", [
    (True, False, torch.bfloat16, "ATEN"),  # AVX512-BF16 without AMX (an AMD EPYC): oneDNN's GEMMs only
    (True, True, torch.bfloat16, "CPP,ATEN"),  # AMX: inductor's tile kernel competes
    (False, False, torch.bfloat16, "CPP,ATEN"),  # AVX2 only: oneDNN has no bf16 kernel for a tree step
    (True, False, torch.float32, "CPP,ATEN"),
])
def test_a_captured_cpu_step_is_frozen_called_from_cpp_and_autotunes_its_gemms_among_the_fast_kernels(
        monkeypatch, native_bf16, amx, dtype, backends):
    monkeypatch.setattr(graph_mode, "native_bf16_cpu", lambda: native_bf16)
    monkeypatch.setattr(graph_mode, "amx_cpu", lambda: amx)
    seen = {}

    def compile(step, **options):  # records the inductor configuration a captured call compiles under
        def compiled(*args):
            seen["backends"] = torch._inductor.config.max_autotune_gemm_backends
            seen["freezing"] = torch._inductor.config.freezing
            seen["cpp_wrapper"] = torch._inductor.config.cpp_wrapper
            return step(*args)
        return compiled

    monkeypatch.setattr(graph_mode.torch, "compile", compile)
    assert graph_mode.capture(lambda x: x * 2, torch.device("cpu"), dtype)(torch.ones(1)).tolist() == [2.0]
    assert seen == {"backends": backends, "freezing": True, "cpp_wrapper": True}


def test_ascend_graph_mode_uses_torchair_and_without_it_says_so(monkeypatch):
    seen = {}

    def get_npu_backend(compiler_config):
        seen["config"] = compiler_config
        return "eager"  # dynamo's own backend name: compiles nothing, so the step runs on the CPU here

    config_module = types.ModuleType("torchair.configs.compiler_config")
    config_module.CompilerConfig = lambda: types.SimpleNamespace(experimental_config=types.SimpleNamespace())
    torchair = types.ModuleType("torchair")
    torchair.get_npu_backend = get_npu_backend
    monkeypatch.setitem(sys.modules, "torchair", torchair)
    monkeypatch.setitem(sys.modules, "torchair.configs", types.ModuleType("torchair.configs"))
    monkeypatch.setitem(sys.modules, "torchair.configs.compiler_config", config_module)
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") exists only with torch_npu
    step = graph_mode.capture(lambda x: x * 2, npu, torch.float32)
    assert seen["config"].experimental_config.frozen_parameter is True
    assert step(torch.ones(2)).tolist() == [2.0, 2.0]
    monkeypatch.setitem(sys.modules, "torchair", None)
    with pytest.raises(ValueError, match="needs torchair"):
        graph_mode.capture(lambda x: x, npu, torch.float32)


def test_compiled_code_is_kept_under_the_home_unless_the_user_chose_a_directory(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from inference.runtime.home import use_compile_cache

    monkeypatch.setenv("OPENPANGU_MEDUSA_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes there itself
    assert use_compile_cache() == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == tmp_path / "mine"


AVX2_TREE_MASK = """
import torch
from inference.engine.dynamic_tree import _paths_and_mask
parent = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 7, 9, 9, 11, 12, 12])
depth_of = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6])
compiled = torch.compile(_paths_and_mask, fullgraph=True, dynamic=False)
for size, depth in ((17, 6), (3, 5)):
    captured, eager = compiled(parent[:size], depth_of[:size], depth), _paths_and_mask(parent[:size], depth_of[:size], depth)
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
"""


def test_the_dynamic_tree_mask_captures_for_cpus_without_avx512(tmp_path):
    """Inductor's AVX2 kernels check every lane of a vector that scatters (padding included): the mask must not be
    built by a scatter, or captured dynamic-tree steps fail on such CPUs. A new process: the ISA is read once."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", AVX2_TREE_MASK], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
