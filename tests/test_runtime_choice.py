"""The dtype and tree are chosen from the machine's measured step costs and the heads' measured accuracy."""

import json
from dataclasses import replace

import pytest
import torch

from inference.runtime.calibration import GraphProfile, StepProfile
from inference.runtime.runtime_choice import (MIN_EXPECTED_SPEEDUP, captured_alternatives, choose_runtime, redecided,
                                              with_graph_mode, with_step_options)
from medusa_choices import DynamicTree, best_tree, expected_accepted, load_tree, validate_tree
import medusa_model
from medusa_model import DEMO_HEADS_DIR
from medusa_helpers import random_heads

SIZES = (2, 3, 4, 5, 7, 9, 13, 17, 25, 33)
BF16, FP32 = torch.bfloat16, torch.float32


def profile_from_table(hardware: str, plain: dict, points: dict) -> StepProfile:
    """A profile from measured (tokens -> ms) points, the plain token as the 1-token point, linear in between,
    at the sizes calibration stores."""
    profile = StepProfile(plain, {d: {1: plain[d], **p} for d, p in points.items()}, hardware)
    return StepProfile(plain, {d: {t: profile.tree_step_ms(d, t) for t in SIZES} for d in points}, hardware)


# Issue 12's AMD EPYC with AVX2 only (no bf16 GEMM kernel): bf16 costs ~k x one token, fp32 is flat. Measured
# with the demo heads: the feature drafter's levels cost more there (each its own bf16 GEMMs).
AVX2 = profile_from_table(
    "AMD EPYC (AVX2, no native bf16), torch 2.13.0+cpu, 2 threads", {BF16: 47.0, FP32: 87.0},
    {BF16: {4: 94.0, 8: 150.0, 13: 238.0, 16: 278.0, 32: 536.0},
     FP32: {4: 135.0, 8: 126.0, 13: 111.0, 16: 113.0, 32: 148.0}})
# A CPU with AVX512-BF16 (this project's development machines): a 13-token bf16 step ~1.3x one token.
NATIVE_BF16 = profile_from_table(
    "AMD EPYC (AVX512, native bf16), torch 2.13.0+cpu, 2 threads", {BF16: 37.6, FP32: 54.4},
    {BF16: {2: 37.2, 5: 41.6, 9: 44.5, 13: 47.6, 17: 54.2, 33: 74.3},
     FP32: {2: 80.0, 5: 80.0, 13: 88.0, 33: 123.5}})


def committed_accuracy(directory) -> list[list[float]]:
    return json.loads((directory / "config.json").read_text())["medusa_head_accuracy"]


def demo_accuracy() -> list[list[float]]:
    return committed_accuracy(DEMO_HEADS_DIR)


# The committed demo heads (3 of their 5 heads, as the tests below) and the demo feature drafter (6 levels)
COMMITTED = [(DEMO_HEADS_DIR, 3), (DEMO_HEADS_DIR.parent / "demo_drafter", 6)]


def test_avx2_cpu_falls_back_to_plain_bf16_with_a_reason():
    choice = choose_runtime(AVX2, 3, demo_accuracy())
    assert choice.tree is None and choice.dtype == choice.plain_dtype == BF16
    assert choice.tree_tokens == 1
    assert "plain decoding in bf16" in choice.reason and "expected at only" in choice.reason


@pytest.mark.parametrize("directory,heads", COMMITTED, ids=["demo_heads", "demo_drafter"])
def test_native_bf16_cpu_runs_medusa_in_bf16_with_a_tree_that_beats_plain(directory, heads):
    choice = choose_runtime(NATIVE_BF16, heads, committed_accuracy(directory))
    assert choice.dtype == choice.plain_dtype == BF16
    assert choice.tree is not None and 2 < choice.tree_tokens <= 33
    assert choice.expected_speedup >= MIN_EXPECTED_SPEEDUP
    validate_tree(choice.tree, num_heads=heads)


def test_flat_fp32_wins_when_bf16_is_only_a_little_faster_per_token():
    # AVX2-like bf16 trees, but a plain fp32 token nearly as cheap as a bf16 one: Medusa in fp32 pays.
    profile = StepProfile({BF16: 47.0, FP32: 50.0}, {BF16: dict(AVX2.step_ms[BF16]),
                                                          FP32: {t: 55.0 + t for t in SIZES}}, AVX2.hardware)
    choice = choose_runtime(profile, 3, demo_accuracy())
    assert choice.dtype == FP32 and choice.plain_dtype == BF16 and choice.tree is not None
    assert "no native bf16 matmul on this CPU" in choice.reason


def test_forced_dtype_compares_with_plain_decoding_in_that_dtype():
    choice = choose_runtime(AVX2, 3, demo_accuracy(), dtype=FP32)
    assert choice.dtype == choice.plain_dtype == FP32 and choice.tree is not None


def test_a_given_tree_is_kept_and_its_gain_estimated():
    tree = load_tree("tree_16")[:12]
    choice = choose_runtime(AVX2, 3, demo_accuracy(), tree=tree)
    assert choice.tree == tree and choice.dtype == FP32  # its 13-token step: 111 ms in fp32, 238 in bf16
    assert choice.expected_tokens_per_step == pytest.approx(1 + expected_accepted(tree, demo_accuracy()), abs=1e-4)


def test_heads_that_propose_after_verification_get_a_dynamic_tree_of_the_size_chosen():
    fixed = choose_runtime(NATIVE_BF16, 3, demo_accuracy())
    dynamic = choose_runtime(NATIVE_BF16, 3, demo_accuracy(), dynamic=True)
    # drafting as many levels as the best fixed tree of that size is deep
    assert dynamic.tree == DynamicTree(len(fixed.tree), levels=max(map(len, fixed.tree))) and dynamic.dtype == fixed.dtype
    assert dynamic.expected_tokens_per_step == fixed.expected_tokens_per_step  # the fixed tree's: a floor
    assert f"{fixed.tree_tokens}-token dynamic tree ({dynamic.tree.levels} levels)" in dynamic.reason
    assert choose_runtime(AVX2, 3, demo_accuracy(), dynamic=True).tree is None  # plain still wins there


def test_a_given_dynamic_tree_is_estimated_as_the_best_fixed_tree_of_its_size():
    choice = choose_runtime(NATIVE_BF16, 3, demo_accuracy(), tree=DynamicTree(12))
    assert choice.tree == DynamicTree(12) and choice.tree_tokens == 13
    assert choice.expected_tokens_per_step == pytest.approx(1 + best_tree(demo_accuracy()[:3], 12)[1], abs=1e-4)


def test_without_accuracy_the_given_tree_runs_in_the_dtype_of_its_fastest_step():
    choice = choose_runtime(AVX2, 3, None, tree=[[0], [1], [2], [0, 0]])
    assert choice.dtype == BF16 and choice.expected_speedup is None  # 5 tokens: 109 ms bf16 vs 133 ms fp32
    assert "record no accuracy" in choice.reason
    with pytest.raises(ValueError):
        choose_runtime(AVX2, 3, None)


def test_step_costs_are_interpolated_between_and_beyond_measured_sizes():
    profile = StepProfile({BF16: 10.0}, {BF16: {2: 10.0, 4: 20.0, 8: 20.0}})
    assert profile.tree_step_ms(BF16, 3) == 15.0
    assert profile.tree_step_ms(BF16, 1) == 10.0
    assert profile.tree_step_ms(BF16, 6) == 20.0
    assert profile.tree_step_ms(BF16, 12) == 20.0


def test_best_tree_is_prefix_closed_and_prefers_likely_paths():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.1, 0.05], [0.4, 0.1, 0.0]]
    tree, expected = best_tree(accuracy, budget=4)
    assert tree == [[0], [0, 0], [1], [0, 0, 0]]
    assert expected == pytest.approx(0.6 + 0.3 + 0.2 + 0.12)
    assert expected_accepted(tree, accuracy) == pytest.approx(expected)
    validate_tree(tree, num_heads=3)


def test_expected_accepted_counts_unmeasured_ranks_and_levels_as_never_right():
    accuracy = [[0.5, 0.25], [0.5]]
    assert expected_accepted([[0], [5], [0, 0], [0, 3], [0, 0, 0]], accuracy) == pytest.approx(0.5 + 0.25)


@pytest.mark.parametrize("step_ms,uses_medusa", [(1.5 * 10 / 1.25, True), (1.5 * 10 / 1.15, False)])
def test_medusa_is_used_from_an_expected_speedup_of_one_point_two(step_ms, uses_medusa):
    """One head right half the time: a 2-token step yields 1.5 tokens, so its speed-up is 15 ms / step ms."""
    profile = StepProfile({FP32: 10.0}, {FP32: {2: step_ms}}, "a CPU")
    choice = choose_runtime(profile, 1, [[0.5]])
    assert (choice.tree is not None) == uses_medusa
    assert choice.expected_speedup == pytest.approx(1.25 if uses_medusa else 1.0)


def pairs(eager: float, captured: float) -> dict[str, float]:
    return {"eager": eager, "captured": captured}


def test_each_side_runs_captured_where_that_was_timed_faster_and_a_fast_plain_step_can_take_over():
    choice = choose_runtime(NATIVE_BF16, 5, demo_accuracy())
    assert choice.tree is not None and not choice.compiled and choice.graph_mode == "eager"
    both = with_graph_mode(choice, GraphProfile({BF16: pairs(37.6, 30.0)}, {BF16: pairs(44.5, 36.0)}))
    assert both.compiled and both.plain_compiled and both.graph_mode == "captured" and both.tree == choice.tree
    assert both.expected_speedup == pytest.approx(choice.expected_tokens_per_step * 30.0 / 36.0, abs=1e-4)
    mixed = with_graph_mode(choice, GraphProfile({BF16: pairs(37.6, 30.0)}, {BF16: pairs(44.5, 50.0)}))
    assert not mixed.compiled and mixed.plain_compiled and mixed.graph_mode == "Medusa eager, plain captured"
    # captured plain steps so cheap that the tree is expected below the threshold: plain decoding, captured
    fast_plain = GraphProfile({BF16: pairs(37.6, 12.0)}, {BF16: pairs(44.5, 40.0)})
    fallback = with_graph_mode(choice, fast_plain)
    assert fallback.tree is None and fallback.compiled and "plain decoding" in fallback.reason
    # a tree the user gave is kept
    assert with_graph_mode(choice, fast_plain, may_fall_back=False).tree == choice.tree


# A 2-core AMD EPYC with AVX512-BF16 and no AMX, the demo feature drafter's 9-token tree, torch 2.13.0+cpu: eager,
# fp32 costs twice what bf16 does; captured, fp32 plain steps are the cheapest of all.
EPYC_GRAPH = GraphProfile({BF16: pairs(22.7, 20.6), FP32: pairs(46.1, 16.0)},
                          {BF16: pairs(36.0, 21.6), FP32: pairs(60.0, 19.0)})


def test_each_side_takes_the_dtype_and_graph_mode_timed_fastest_even_against_the_eager_order():
    choice = choose_runtime(NATIVE_BF16, 6, committed_accuracy(COMMITTED[1][0]), dynamic=True)
    assert choice.dtype == choice.plain_dtype == BF16  # eager costs chose bf16
    captured = with_graph_mode(choice, EPYC_GRAPH)
    assert (captured.dtype, captured.compiled, captured.plain_dtype, captured.plain_compiled) == (FP32, True, FP32, True)
    assert captured.tree == choice.tree
    assert captured.expected_speedup == pytest.approx(choice.expected_tokens_per_step * 16.0 / 19.0, abs=1e-4)
    assert captured.reason.startswith(f"fp32, {choice.tree_tokens}-token dynamic tree") and \
        "fp32 captured 19.0 ms step vs fp32 captured plain 16.0 ms" in captured.reason
    # each side on its own: the tree's step cheapest in bf16, the plain step in fp32
    split = with_graph_mode(choice, replace(EPYC_GRAPH, step_ms={BF16: pairs(36.0, 18.0), FP32: pairs(60.0, 19.0)}))
    assert (split.dtype, split.plain_dtype) == (BF16, FP32)
    # plain decoding chosen from eager costs: it runs in the dtype and mode timed fastest
    plain = with_graph_mode(replace(choice, tree=None), replace(EPYC_GRAPH, step_ms=None))
    assert (plain.dtype, plain.plain_dtype, plain.compiled) == (FP32, FP32, True)
    assert plain.reason.endswith("fastest here: fp32 captured plain 16.0 ms")
    # a captured fp32 tree step costs the options the schedule weighs in fp32
    options = with_step_options(captured, NATIVE_BF16, committed_accuracy(COMMITTED[1][0]), 6, False, EPYC_GRAPH).options
    assert [(o.tokens, o.profile_ms) for o in options] == [(choice.tree_tokens, 19.0), (1, 16.0)]


def test_a_captured_tree_is_the_size_whose_captured_step_gives_the_most_tokens_per_ms():
    """Eager costs choose the tree; captured steps of sizes two timed sizes below and above it are timed against it,
    and the one expected to give the most tokens per captured ms runs."""
    accuracy = demo_accuracy()
    choice = choose_runtime(NATIVE_BF16, 5, accuracy, dynamic=True)
    alternatives = captured_alternatives(choice, NATIVE_BF16, accuracy, 5)
    position = SIZES.index(choice.tree_tokens)
    assert [o.tokens for o in alternatives] == [SIZES[position - 2], SIZES[position + 2]]
    assert all(isinstance(o.tree, DynamicTree) and o.expected_tokens == 1 + best_tree(accuracy, o.tokens - 1)[1]
               for o in alternatives)
    smaller, larger = alternatives
    plain = {BF16: pairs(37.6, 20.0), FP32: pairs(54.4, 30.0)}
    steps = {BF16: pairs(44.5, 24.0), FP32: pairs(80.0, 40.0)}

    def timed(ms: dict[int, float]) -> GraphProfile:
        return GraphProfile(plain, steps, ms)

    # every size costs about the same captured: the largest gives the most tokens, weighed against the plain step
    # of the same rounds, and its step is what the schedule weighs
    equal = timed({1: 18.0, smaller.tokens: 24.0, choice.tree_tokens: 24.0, larger.tokens: 23.0})
    same = with_graph_mode(choice, equal, alternatives=alternatives)
    assert same.tree == larger.tree and same.expected_tokens_per_step == pytest.approx(larger.expected_tokens, abs=1e-4)
    assert same.expected_speedup == pytest.approx(larger.expected_tokens * 18.0 / 23.0, abs=1e-4)
    assert f"the {larger.tokens}-token one gives most" in same.reason and same.compiled
    # the schedule weighs the step against the plain step of the same rounds
    options = with_step_options(same, NATIVE_BF16, accuracy, 5, False, equal).options
    assert [o.profile_ms for o in options] == [23.0, 18.0]
    # ... of the tree sizes' rounds only where their plain step ran captured in the tree's dtype
    fp32_plain = replace(equal, plain_ms={BF16: pairs(37.6, 20.0), FP32: pairs(54.4, 15.0)})
    assert [o.profile_ms for o in with_step_options(same, NATIVE_BF16, accuracy, 5, False, fp32_plain).options] \
        == [24.0, 20.0]
    # the smaller step so cheap that it gives the most tokens per ms
    cheap = {smaller.tokens: 24.0 * smaller.expected_tokens / choice.expected_tokens_per_step / 1.5,
             choice.tree_tokens: 24.0, larger.tokens: 24.0 * larger.expected_tokens / choice.expected_tokens_per_step}
    assert with_graph_mode(choice, timed(cheap), alternatives=alternatives).tree == smaller.tree
    # the chosen tree where the others cost more per token
    dear = cheap | {smaller.tokens: 100.0, larger.tokens: 100.0}
    kept = with_graph_mode(choice, timed(dear), alternatives=alternatives)
    assert kept.tree == choice.tree and kept.expected_speedup == pytest.approx(
        choice.expected_tokens_per_step * 20.0 / 24.0, abs=1e-4)
    # eager steps, or sizes not timed captured, leave the tree chosen from eager costs
    eager = GraphProfile(plain, {BF16: pairs(20.0, 30.0), FP32: pairs(80.0, 90.0)}, dict(cheap))
    assert with_graph_mode(choice, eager, alternatives=alternatives).tree == choice.tree
    assert with_graph_mode(choice, timed({}), alternatives=alternatives).tree == choice.tree
    # a tree the user gave has no alternatives
    assert captured_alternatives(choose_runtime(NATIVE_BF16, 3, accuracy, BF16, load_tree("tree_16")),
                                 NATIVE_BF16, None, 3) == ()


def test_a_chosen_tree_competes_at_every_step_with_the_sizes_next_to_it_and_the_plain_step():
    choice = choose_runtime(NATIVE_BF16, 5, demo_accuracy(), dynamic=True)
    choice = with_step_options(choice, NATIVE_BF16, demo_accuracy(), 5, tree_given=False)
    first, *trees, plain = choice.options
    assert first.tree == choice.tree and plain.tree is None and len(trees) == 2
    assert all(isinstance(o.tree, DynamicTree) for o in (first, *trees))
    # the chosen size's levels at every size, so a switch of size keeps the candidates scored the step before
    assert first.tree.levels == max(map(len, best_tree(demo_accuracy()[:5], first.tokens - 1)[0]))
    assert {o.tree.levels for o in trees} == {first.tree.levels}
    assert len({o.tokens for o in choice.options}) == 4
    position = SIZES.index(first.tokens)  # the sizes next to the chosen one, so corrections can walk the sizes
    assert [o.tokens for o in trees] == [SIZES[position - 1], SIZES[position + 1]]
    assert plain.profile_ms == NATIVE_BF16.plain_ms[BF16] and first.expected_tokens == choice.expected_tokens_per_step


def test_a_given_or_captured_tree_competes_with_the_plain_step_only():
    given = choose_runtime(NATIVE_BF16, 3, demo_accuracy(), BF16, load_tree("tree_16"))
    assert [o.tokens for o in with_step_options(given, NATIVE_BF16, demo_accuracy(), 3, True).options] == [17, 1]
    chosen = choose_runtime(NATIVE_BF16, 3, demo_accuracy())
    captured = replace(chosen, compiled=True)
    graph = GraphProfile({BF16: pairs(40.0, 20.0)}, {BF16: pairs(50.0, 30.0)})
    timed = with_step_options(captured, NATIVE_BF16, demo_accuracy(), 3, False, graph)
    assert [(o.tokens, o.profile_ms) for o in timed.options] == [(chosen.tree_tokens, 30.0), (1, 20.0)]
    assert timed.options_timed and timed.profile is None  # captured costs do not correct the eager profile
    assert with_step_options(captured, NATIVE_BF16, demo_accuracy(), 3, False).options == ()  # nothing timed


def test_a_choice_from_a_wrong_profile_is_decided_again_as_from_the_right_one_once_corrected():
    right = choose_runtime(NATIVE_BF16, 5, demo_accuracy(), BF16, dynamic=True)
    smallest = min(SIZES)
    wrong = StepProfile({BF16: NATIVE_BF16.plain_ms[BF16] * 17},
                        {BF16: {t: ms * (1 if t == smallest else 51) for t, ms in NATIVE_BF16.step_ms[BF16].items()}})
    misled = with_step_options(choose_runtime(wrong, 5, demo_accuracy(), BF16, dynamic=True), wrong, demo_accuracy(),
                               5, tree_given=False)
    assert misled.tree_tokens == smallest != right.tree_tokens
    timed = {o.tokens: NATIVE_BF16.cost_ms(BF16, o.tokens) for o in misled.options}
    again = redecided(misled, wrong.corrected(BF16, timed), 5, demo_accuracy())
    assert again.tree == right.tree and again.options[0].tree == right.tree


def test_a_fallback_to_plain_decoding_stays_plain_decoding():
    choice = choose_runtime(AVX2, 3, demo_accuracy())
    assert choice.tree is None and with_step_options(choice, AVX2, demo_accuracy(), 3, tree_given=False).options == ()


def test_a_tree_eager_costs_reject_is_timed_captured_and_runs_where_captured_steps_pay(tiny_pangu, monkeypatch):
    """With bf16 limited to AVX2 an eager tree step costs about as many plain steps as it has tokens, a captured one
    far less (`graph_profile` with the demo drafter on a 2-core EPYC: 5 tokens 85.6 ms eager, 27.3 captured, against
    a plain token's 22.4 and 12.1)."""
    model = tiny_pangu[1]
    heads = random_heads(model, 3, head_input="hidden_and_path")
    heads.config.medusa_head_accuracy = demo_accuracy()[:3]
    monkeypatch.setattr(medusa_model, "step_profile", lambda *args, **kwargs: AVX2)
    plain = {BF16: pairs(22.4, 12.1), FP32: pairs(48.7, 18.7)}
    timed = []

    def profile(step_ms: float):
        def graph(model, heads, tree, dtypes, log, alternatives):
            timed.append(tree)
            return GraphProfile(plain, {BF16: pairs(85.6, step_ms), FP32: pairs(87.8, 36.8)})
        return graph

    monkeypatch.setattr(medusa_model, "graph_profile", profile(13.0))
    captured = medusa_model.choose_for_hardware(model, heads, None, None, lambda line: None, "auto")
    assert timed[-1] is not None and captured.tree == timed[-1] and captured.compiled and captured.dtype == BF16
    assert captured.expected_speedup >= MIN_EXPECTED_SPEEDUP
    # where the captured tree does not pay either, plain decoding, captured
    monkeypatch.setattr(medusa_model, "graph_profile", profile(40.0))
    plain_only = medusa_model.choose_for_hardware(model, heads, None, None, lambda line: None, "auto")
    assert plain_only.tree is None and plain_only.compiled and "expected at only" in plain_only.reason
    # eager only: the eager costs decide, and nothing is timed
    timed.clear()
    assert medusa_model.choose_for_hardware(model, heads, None, None, lambda line: None, "off").tree is None
    assert timed == []
    # always captured: the same timing chooses the tree, and the dtype among captured steps only (fp32's eager plain
    # step is the fastest step here, its captured one is not)
    plain[FP32] = pairs(10.0, 18.7)
    monkeypatch.setattr(medusa_model, "graph_profile", profile(13.0))
    forced = medusa_model.choose_for_hardware(model, heads, None, None, lambda line: None, "on")
    assert timed[-1] is not None and forced.tree == timed[-1] and forced.compiled and forced.plain_compiled
    assert forced.dtype == forced.plain_dtype == BF16


def test_plain_decoding_runs_in_the_dtype_its_eager_and_captured_timings_found_fastest(tiny_pangu, monkeypatch,
                                                                                      capsys):
    """Eager costs order bf16 first; timed eager against captured in each dtype, fp32 eager is the fastest."""
    from inference import generate
    from inference.engine.plain_decoding import PlainDecoder

    monkeypatch.setattr(generate, "step_profile", lambda *args, **kwargs: StepProfile({BF16: 10.0, FP32: 20.0},
                                                                                      {BF16: {}, FP32: {}}))
    timed = []
    monkeypatch.setattr(generate, "graph_profile", lambda model, heads, tree, dtypes: timed.extend(dtypes) or
                        GraphProfile({BF16: pairs(10.0, 12.0), FP32: pairs(5.0, 8.0)}, None))
    argv = ["--base_model", str(tiny_pangu[0]), "--prompt", "hi", "--max_new_tokens", "4", "--json"]
    assert generate.main(argv + ["--compile", "auto"]) == 0
    err = capsys.readouterr().err
    assert timed == [BF16, FP32] and "plain decoding in fp32" in err and "Graph mode: eager steps" in err
    assert generate.main(argv + ["--compile", "off"]) == 0
    assert "plain decoding in bf16" in capsys.readouterr().err
    # always captured: the dtype whose captured step was fastest (the step itself runs eager here, to spare a compile)
    monkeypatch.setattr(generate, "PlainDecoder", lambda model, captured, log: PlainDecoder(model, False, log=log))
    assert generate.main(argv + ["--compile", "on"]) == 0
    err = capsys.readouterr().err
    assert "plain decoding in fp32" in err and "Graph mode: captured steps" in err


# Plain steps timed eager and captured (ms) on each machine class, as the benchmark or `graph_profile` measured them
PLAIN_STEPS = {
    # 2-core Intel Xeon with AMX: the benchmark's 34.34 / 64.48 tok/s in bf16, 30.92 / 39.78 in fp32
    "native bf16 with AMX": ({BF16: pairs(29.1, 15.5), FP32: pairs(32.3, 25.1)}, BF16),
    # 2-core AMD EPYC with AVX512-BF16 and no AMX, `graph_profile` with the demo heads
    "native bf16 without AMX": ({BF16: pairs(17.39, 11.479), FP32: pairs(39.793, 14.584)}, BF16),
    # the same EPYC with an earlier engine, its bf16 steps on inductor's GEMMs and bf16 attention: fp32 captured won
    "native bf16 without AMX, earlier engine": ({BF16: pairs(22.96, 22.47), FP32: pairs(45.99, 17.85)}, FP32),
    # the same EPYC limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), `graph_profile`
    "AVX2 only": ({BF16: pairs(14.58, 11.84), FP32: pairs(40.485, 16.47)}, BF16),
}


@pytest.mark.parametrize("machine", PLAIN_STEPS)
def test_plain_decoding_runs_captured_in_the_dtype_each_machine_class_timed_fastest(machine):
    plain_ms, fastest = PLAIN_STEPS[machine]
    eager = AVX2 if machine == "AVX2 only" else NATIVE_BF16
    choice = choose_runtime(eager, 3, demo_accuracy())
    assert (choice.tree is None) == (machine == "AVX2 only")  # an AVX2-only CPU falls back to plain decoding
    plain = with_graph_mode(replace(choice, tree=None), GraphProfile(plain_ms, None))
    assert (plain.dtype, plain.plain_dtype, plain.compiled, plain.plain_compiled) == (fastest, fastest, True, True)
