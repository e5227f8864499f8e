"""Step costs are measured once per machine and model, interleaved, cached, and re-measured when stale."""

import json
import threading
import time
from dataclasses import replace

import pytest
import torch

from inference.engine.decoding import DecodeRequest
from inference.runtime import calibration
from inference.runtime.outputs import exclusive

BF16, FP32 = torch.bfloat16, torch.float32
from medusa_choices import DynamicTree
from medusa_helpers import random_heads
from medusa_model import MedusaModel, save_heads


@pytest.fixture
def quick_calibration(monkeypatch, tmp_path):
    """Calibration under a fresh home, with two tree sizes and one round; counts the measurements."""
    monkeypatch.setenv("OPENPANGU_MEDUSA_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "CPU_STEP_SIZES", (2, 5))
    monkeypatch.setattr(calibration, "ROUNDS", 1)
    measured = []
    real = calibration.measure

    def counting(*args, **kwargs):
        measured.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "measure", counting)
    # the real timings of a tiny model on a shared test machine prove nothing about trust: the tests of
    # `doubts` below feed it timings of their own
    monkeypatch.setattr(calibration, "doubts", lambda *args: [])
    monkeypatch.setattr(calibration, "busy", lambda share: [])
    return measured


def fake_clock(durations_ms):
    """A clock under which the timed calls last `durations_ms`, in the order they are timed."""
    durations, now, started = iter(durations_ms), [0.0], [False]

    def read():
        if started[0]:
            now[0] += next(durations) / 1000
        started[0] = not started[0]
        return now[0]
    return read


def rounds_of(plain, two, five, rounds=5, bursts=()):
    """Durations of the warm-up round and `rounds` rounds of (plain, 2-token, 5-token) fp32 steps, each
    with a little jitter; the steps at (round, position) in `bursts` take four times as long."""
    durations = []
    for round_index in range(rounds + 1):
        for position, ms in enumerate((plain, two, five)):
            jitter = 1 + 0.02 * ((round_index + position) % 3 - 1)
            factor = 4 if (round_index, position) in bursts else 1
            durations.append(ms * jitter * factor)
    return durations


@pytest.fixture
def timed(monkeypatch, quick_calibration):
    """`quick_calibration` over five rounds with the real `doubts`: returns a function that calibrates under a
    given sequence of step durations and share of the CPU taken by other processes, and what it logged."""
    monkeypatch.setattr(calibration, "ROUNDS", 5)
    monkeypatch.setattr(calibration, "doubts", doubts)
    monkeypatch.setattr(calibration, "busy", busy)
    meter = calibration.LoadMeter

    def calibrate(model, heads, durations, others_share=0.0):
        monkeypatch.setattr(calibration, "clock", fake_clock(durations))
        busy = others_share * 10 * 2
        readings = iter([(100.0, 10.0), (100.0 + 20 + busy, 30.0)])
        elapsed = iter([0.0, 10.0])
        monkeypatch.setattr(calibration, "LoadMeter", lambda: meter(lambda: next(readings), lambda: next(elapsed), cpus=2))
        lines = []
        profile = calibration.step_profile(model, heads, [FP32], lines.append)
        return profile, lines
    return calibrate


doubts, busy = calibration.doubts, calibration.busy


def test_a_calibration_with_agreeing_plausible_rounds_on_a_quiet_machine_is_kept(tiny_pangu, timed):
    model, heads = tiny_pangu[1], random_heads(tiny_pangu[1], 2)
    profile, lines = timed(model, heads, rounds_of(10, 12, 15))
    assert round(profile.plain_ms[FP32]) == 10 and not any("Not keeping" in line for line in lines)
    assert len(list(calibration.calibration_dir().glob("*.json"))) == 1


@pytest.mark.parametrize("case, why", [
    ("burst", "rounds disagree"),
    ("busy", "other processes took 50% of the CPU time"),
    ("larger step cheaper", "5-token step (5.0 ms) timed far below a 2-token one"),
    ("plain slower", "plain step (25.0 ms) timed slower than a 2-token step"),
])
def test_a_noisy_busy_or_implausible_calibration_serves_this_run_only(tiny_pangu, timed, quick_calibration, case, why):
    model, heads = tiny_pangu[1], random_heads(tiny_pangu[1], 2)
    durations = {
        "burst": rounds_of(10, 12, 15, bursts={(3, 2), (4, 2)}),  # one burst alone moves no median
        "busy": rounds_of(10, 12, 15),
        "larger step cheaper": rounds_of(10, 12, 5),
        "plain slower": rounds_of(25, 12, 15),
    }[case]
    profile, lines = timed(model, heads, durations, others_share=0.5 if case == "busy" else 0.0)
    notice = [line for line in lines if line.startswith("Not keeping this calibration")]
    assert len(notice) == 1 and why in notice[0], lines
    assert not list(calibration.calibration_dir().glob("*.json"))
    timed(model, heads, rounds_of(10, 12, 15))  # the next run measures again, and keeps a clean result
    assert len(quick_calibration) == 2 and len(list(calibration.calibration_dir().glob("*.json"))) == 1


def test_the_load_meter_counts_other_processes_cpu_time_not_its_own():
    readings = iter([(100.0, 10.0), (130.0, 30.0)])  # machine busy 30 s of which this process 20 s
    elapsed = iter([5.0, 15.0])
    with calibration.LoadMeter(lambda: next(readings), lambda: next(elapsed), cpus=2) as load:
        pass
    assert load.share == pytest.approx(10 / (10 * 2))
    with calibration.LoadMeter(lambda: None) as unknown:
        pass
    assert unknown.share is None


def test_calibration_measures_once_and_reuses_the_profile(tiny_pangu, quick_calibration):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    profile = calibration.step_profile(model, heads, log=lambda line: None)
    assert quick_calibration == [[BF16, FP32]]
    assert set(profile.plain_ms) == {BF16, FP32} and all(set(s) == {2, 5} for s in profile.step_ms.values())
    assert model.dtype == torch.float32  # the other dtype was timed on a copy
    assert calibration.step_profile(model, heads, log=lambda line: None) == profile
    assert len(quick_calibration) == 1


def test_deleting_or_corrupting_the_cache_measures_again_with_one_notice(tiny_pangu, quick_calibration):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    [cached] = list(calibration.calibration_dir().glob("*.json"))
    cached.unlink()
    calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    assert len(quick_calibration) == 2
    cached.write_text('{"profile": {"plain_ms": ')
    notices = []
    calibration.step_profile(model, heads, [FP32], log=notices.append)
    assert len(quick_calibration) == 3
    assert sum("unreadable" in line for line in notices) == 1


def test_another_thread_count_or_other_heads_measure_again(tiny_pangu, quick_calibration):
    model = tiny_pangu[1]
    threads = torch.get_num_threads()
    calibration.step_profile(model, random_heads(model, num_heads=2), [FP32], log=lambda line: None)
    calibration.step_profile(model, random_heads(model, num_heads=3), [FP32], log=lambda line: None)
    torch.set_num_threads(1)
    try:
        calibration.step_profile(model, random_heads(model, num_heads=3), [FP32], log=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    assert len(quick_calibration) == 3


def test_plain_only_profile_times_the_plain_step(tiny_pangu, quick_calibration):
    profile = calibration.step_profile(tiny_pangu[1], None, [FP32], log=lambda line: None)
    assert profile.plain_ms[FP32] > 0 and profile.step_ms == {FP32: {}}


def test_timing_runs_every_size_in_turn_and_drops_the_warm_up_round():
    calls = []

    def runner(name, warm_up_s=0.0):
        def run():
            if warm_up_s and name not in calls:
                time.sleep(warm_up_s)
            calls.append(name)
        return run

    metered = []

    class Meter:
        def __enter__(self):
            metered.append(len(calls))

        def __exit__(self, *exc):
            metered.append(len(calls))

    ms = calibration.interleaved_ms({"plain": runner("plain", 0.3), 8: runner(8)}, repeats=1, device=torch.device("cpu"),
                                    load=Meter())
    assert calls == ["plain", 8] * 2
    assert set(ms) == {"plain", 8} and ms["plain"] < 100
    assert metered == [2, 4]  # the load is metered over the timed rounds, not the warm-up (where steps compile)


def test_a_step_runner_lasts_for_the_calls_it_was_made_for_even_when_every_token_is_accepted(tiny_pangu):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    heads.states = lambda hidden, num_heads=None, token_embeds=None: hidden.expand(num_heads, *hidden.shape)
    run = calibration.step_runner(model, calls=4, tree=[[0], [0, 0], [1]], heads=heads, context=8)
    for _ in range(4):
        run()


def test_a_dtype_whose_model_copy_does_not_fit_in_memory_is_not_timed(tiny_pangu, quick_calibration, monkeypatch):
    model = tiny_pangu[1]  # fp32: a bf16 copy needs half its bytes
    bf16_copy = sum(p.numel() for p in model.parameters()) * 2
    monkeypatch.setattr(calibration, "free_memory", lambda device: bf16_copy)
    notices = []
    profile = calibration.step_profile(model, random_heads(model, num_heads=2), log=notices.append)
    assert set(profile.plain_ms) == {FP32} and quick_calibration == [[FP32]]
    assert any("not timing bf16" in line for line in notices)
    monkeypatch.setattr(calibration, "free_memory", lambda device: 10 * bf16_copy)
    assert set(calibration.step_profile(model, random_heads(model, num_heads=2), log=notices.append).plain_ms) == {BF16, FP32}


def test_calibration_times_the_kind_of_tree_auto_decodes_with(tiny_pangu, quick_calibration, monkeypatch):
    """Heads that propose after verification decode with dynamic trees, whose level-by-level drafting costs more
    than a fixed tree of the same size: timing a fixed tree for them overstated the speed-up."""
    model = tiny_pangu[1]
    timed = []
    real = calibration.step_runner

    def recording(model, calls, tree=None, heads=None, context=calibration.CONTEXT):
        timed.append(tree)
        return real(model, calls, tree, heads, context)

    monkeypatch.setattr(calibration, "step_runner", recording)
    calibration.step_profile(model, random_heads(model, num_heads=2, head_input="hidden_and_path"), [FP32],
                             log=lambda line: None)
    assert [tree for tree in timed if tree is not None] == [DynamicTree(1), DynamicTree(4)]
    timed.clear()
    calibration.step_profile(model, random_heads(model, num_heads=2), [FP32], log=lambda line: None)
    trees = [tree for tree in timed if tree is not None]
    assert [len(tree) for tree in trees] == [1, 4] and not any(isinstance(tree, DynamicTree) for tree in trees)
    assert len(quick_calibration) == 2  # the two kinds are cached apart


def test_the_cache_key_tells_apart_every_machine_model_heads_and_tree_kind(tiny_pangu, monkeypatch):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)

    def path(heads=heads):
        return calibration.profile_path(calibration.profile_key(model, heads, [FP32], (2, 5)))

    base = path()
    # this machine's capability and packing; the key must change when either is the other
    other_capability = "AVX512" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "AVX2"
    packed = calibration.packing_supported()
    changes = [
        lambda patch: patch.setattr(calibration, "cpu_name", lambda: "Another CPU"),
        lambda patch: patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other_capability),
        lambda patch: patch.setattr(torch, "__version__", "2.99.0"),
        lambda patch: patch.setattr(torch, "get_num_threads", lambda: 7),
        lambda patch: patch.setattr(model.config, "_name_or_path", "another/model"),
        lambda patch: patch.setattr(model.config, "num_hidden_layers", 99),
        lambda patch: patch.setattr(calibration, "packing_supported", lambda: not packed),  # either way
    ]
    for change in changes:
        with monkeypatch.context() as patch:
            change(patch)
            assert path() != base
    assert path(random_heads(model, num_heads=3)) != base
    assert path(random_heads(model, num_heads=2, layout="own_lm_head")) != base
    assert path(random_heads(model, num_heads=2, head_input="hidden_and_path")) != base  # dynamic trees are timed
    assert path() == base


def valid_profile(sizes=(2, 5)) -> dict:
    return {"plain_ms": {"fp32": 10.0}, "step_ms": {"fp32": {str(t): 10.0 + t for t in sizes}}}


UNUSABLE_PROFILES = {
    "syntax": '{"profile": {"plain_ms": ',
    "not an object": "[1, 2]",
    "no profile": "{}",
    "empty tables": '{"profile": {"plain_ms": {}, "step_ms": {}}}',
    "empty step table": '{"profile": {"plain_ms": {"fp32": 10.0}, "step_ms": {"fp32": {}}}}',
    "a size missing": {"profile": valid_profile(sizes=(2,))},
    "another dtype": {"profile": {"plain_ms": {"bf16": 10.0}, "step_ms": {"bf16": {"2": 12.0, "5": 15.0}}}},
    "zero": {"profile": valid_profile() | {"plain_ms": {"fp32": 0.0}}},
    "negative": {"profile": {"plain_ms": {"fp32": 10.0}, "step_ms": {"fp32": {"2": -1.0, "5": 15.0}}}},
    "nan": '{"profile": {"plain_ms": {"fp32": NaN}, "step_ms": {"fp32": {"2": 12.0, "5": 15.0}}}}',
    "infinite": '{"profile": {"plain_ms": {"fp32": 10.0}, "step_ms": {"fp32": {"2": Infinity, "5": 15.0}}}}',
    "text": {"profile": {"plain_ms": {"fp32": "fast"}, "step_ms": {"fp32": {"2": 12.0, "5": 15.0}}}},
}


@pytest.mark.parametrize("kind", UNUSABLE_PROFILES)
def test_every_unusable_cached_profile_is_measured_again_with_one_notice(tiny_pangu, quick_calibration, kind):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    [cached] = calibration.calibration_dir().glob("*.json")
    content = UNUSABLE_PROFILES[kind]
    cached.write_text(content if isinstance(content, str) else json.dumps(content))
    notices = []
    profile = calibration.step_profile(model, heads, [FP32], log=notices.append)
    assert len(quick_calibration) == 2 and sum("unreadable" in line for line in notices) == 1
    assert profile.plain_ms[FP32] > 0 and set(profile.step_ms[FP32]) == {2, 5}
    assert calibration.step_profile(model, heads, [FP32], log=notices.append) == profile  # the new one was kept


def test_a_valid_cached_profile_is_used_as_it_is(tiny_pangu, quick_calibration):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    [cached] = calibration.calibration_dir().glob("*.json")
    cached.write_text(json.dumps({"profile": valid_profile()}))
    profile = calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    assert len(quick_calibration) == 1 and profile.step_ms == {FP32: {2: 12.0, 5: 15.0}}


def test_an_unwritable_home_calibrates_for_this_run_only_and_says_so(tiny_pangu, quick_calibration, monkeypatch,
                                                                     tmp_path):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("OPENPANGU_MEDUSA_HOME", str(tmp_path / "a_file" / "home"))  # cannot be created
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    notices = []
    for _ in range(2):
        profile = calibration.step_profile(model, heads, [FP32], log=notices.append)
    assert profile.plain_ms[FP32] > 0 and len(quick_calibration) == 2
    assert sum("for this run only" in line for line in notices) == 2


def test_a_second_calibration_of_one_key_waits_for_the_first_and_takes_its_profile(tiny_pangu, quick_calibration):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    path = calibration.profile_path(calibration.profile_key(model, heads, [FP32], (2, 5)))
    path.parent.mkdir(parents=True)
    notices, results = [], []
    with exclusive(path, busy="held"):  # the first process, calibrating
        second = threading.Thread(target=lambda: results.append(
            calibration.step_profile(model, heads, [FP32], log=notices.append)))
        second.start()
        for _ in range(100):
            if notices:
                break
            time.sleep(0.05)
        path.write_text(json.dumps({"profile": valid_profile()}))  # the first one's result
    second.join()
    assert any("Waiting for another process" in line for line in notices)
    assert quick_calibration == [] and results[0].step_ms == {FP32: {2: 12.0, 5: 15.0}}


def test_costs_timed_in_real_steps_replace_the_profiles_and_are_read_back_as_realised(tiny_pangu, quick_calibration):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    profile = calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    plain, two, five = profile.plain_ms[FP32], profile.step_ms[FP32][2], profile.step_ms[FP32][5]
    notices = []
    calibration.write_correction(profile, FP32, {1: plain * 10, 2: two * 2}, log=notices.append)
    again = calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    assert len(quick_calibration) == 1 and again.realised == {FP32: [1, 2]}
    assert again.plain_ms[FP32] == pytest.approx(plain * 10, abs=1e-3)
    assert again.step_ms[FP32] == pytest.approx({2: two * 2, 5: five * 2}, abs=1e-3)  # 5 moves with the nearest
    assert len(notices) == 1 and "10.0x off what real steps cost" in notices[0]


def test_a_profile_that_serves_one_run_only_is_not_corrected_on_disk(tiny_pangu, quick_calibration):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2)
    profile = calibration.step_profile(model, heads, [FP32], log=lambda line: None)
    [cached] = calibration.calibration_dir().glob("*.json")
    before = cached.read_text()
    calibration.write_correction(replace(profile, path=None), FP32, {1: 1.0}, log=lambda line: None)
    assert cached.read_text() == before


def test_a_model_started_from_a_cached_profile_10x_off_corrects_it_while_decoding(tiny_pangu, quick_calibration,
                                                                                   tmp_path, capsys):
    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=2)
    heads.config.medusa_head_accuracy = [[0.6, 0.2], [0.5, 0.1]]
    save_heads(heads, tmp_path / "heads")

    def load():
        return MedusaModel.from_pretrained(str(directory), str(tmp_path / "heads"), "cpu", "fp32", compile="off",
                                           log=lambda line: None)

    load()  # calibrates
    [cached] = calibration.calibration_dir().glob("*.json")
    data = json.loads(cached.read_text())
    true_plain = data["profile"]["plain_ms"]["fp32"]
    data["profile"]["plain_ms"]["fp32"] = true_plain * 10
    cached.write_text(json.dumps(data))
    medusa = load()
    assert sum(map(len, medusa.decode(DecodeRequest([1, 5, 9], 40)))) == 40
    assert "off what real steps cost" in capsys.readouterr().err
    corrected = json.loads(cached.read_text())["profile"]
    assert corrected["realised"] == {"fp32": [1, 2, 5]} and corrected["plain_ms"]["fp32"] < true_plain * 5
    assert len(quick_calibration) == 1


def test_a_captured_step_that_fails_on_this_machine_is_timed_eager_with_one_line_and_not_kept(
        tiny_pangu, quick_calibration, monkeypatch):
    """An inductor kernel that fails where it runs (seen: an index check in a generated kernel under the AVX2
    emulation) must leave both sides eager with a notice, not end the run with a traceback."""
    model = tiny_pangu[1]
    real = calibration.step_runner

    def failing_when_captured(model, calls, tree=None, heads=None, context=calibration.CONTEXT, captured=False):
        run = real(model, calls, tree, heads, context, captured=False)
        if not captured:
            return run

        def fail():
            raise RuntimeError("kernel, main.cpp:770, index out of bounds: 0 <= tmp8 < 3L")

        return fail

    monkeypatch.setattr(calibration, "step_runner", failing_when_captured)
    heads = random_heads(model, num_heads=2, head_input="hidden_and_path")
    notices = []
    graph = calibration.graph_profile(model, heads, DynamicTree(2), [FP32], log=notices.append)
    assert graph.plain_ms[FP32]["captured"] == graph.step_ms[FP32]["captured"] == float("inf")
    assert 0 < graph.plain_ms[FP32]["eager"] < float("inf") and 0 < graph.step_ms[FP32]["eager"] < float("inf")
    assert any("failed on this machine" in line and "index out of bounds" in line for line in notices)
    assert not any(calibration.calibration_dir().glob("*.json"))  # the next run tries capturing again


def test_eager_and_captured_steps_are_timed_in_every_dtype_once_and_then_read_from_the_cache(
        tiny_pangu, quick_calibration, monkeypatch):
    """Captured steps can order the dtypes otherwise than eager ones, so each dtype is timed both ways."""
    model = tiny_pangu[1]
    runs = []

    def recorded(model, calls, tree=None, heads=None, context=calibration.CONTEXT, captured=False):
        assert tree is None or next(heads.parameters()).dtype == model.dtype
        runs.append(("plain" if tree is None else "step", model.dtype, captured))
        return lambda: time.sleep(0.002)  # a timing the cache keeps (it keeps positive ms only)

    monkeypatch.setattr(calibration, "step_runner", recorded)
    heads = random_heads(model, num_heads=2, head_input="hidden_and_path")
    notices = []
    graph = calibration.graph_profile(model, heads, DynamicTree(2), [BF16, FP32], log=notices.append)
    assert sorted(set(runs), key=str) == sorted({(side, dtype, captured) for side in ("plain", "step")
                                                 for dtype in (BF16, FP32) for captured in (False, True)}, key=str)
    assert set(graph.plain_ms) == set(graph.step_ms) == {BF16, FP32}
    assert all(set(modes) == {"eager", "captured"} for modes in [*graph.plain_ms.values(), *graph.step_ms.values()])
    assert model.dtype == FP32 and "in bf16, fp32 once" in notices[0]
    runs.clear()
    assert calibration.graph_profile(model, heads, DynamicTree(2), [BF16, FP32], log=notices.append) == graph
    assert runs == [] and len(notices) == 1
    # the plain step alone, in one dtype, is a profile of its own
    alone = calibration.graph_profile(model, None, None, [FP32], log=notices.append)
    assert alone.step_ms is None and set(alone.plain_ms) == {FP32} and set(runs) == {("plain", FP32, False),
                                                                                  ("plain", FP32, True)}


def test_captured_steps_of_other_tree_sizes_are_timed_in_the_fastest_dtype_once_and_then_read_from_the_cache(
        tiny_pangu, quick_calibration, monkeypatch):
    """Tree sizes are compared captured in the one dtype whose captured step was fastest, a few steps per round."""
    model = tiny_pangu[1]
    runs = []

    def recorded(model, calls, tree=None, heads=None, context=calibration.CONTEXT, captured=False):
        tokens = 1 if tree is None else len(tree) + 1
        runs.append((tokens, model.dtype, captured))
        # 6 ms apart: with one timed round, a 2 ms gap flipped under a busy test run (one sleep overshooting)
        seconds = {(FP32, True): 0.012, (BF16, True): 0.024}.get((model.dtype, captured), 0.018) / (1 + (tokens == 5))
        return lambda: time.sleep(seconds)

    monkeypatch.setattr(calibration, "step_runner", recorded)
    heads = random_heads(model, num_heads=2, head_input="hidden_and_path")
    notices = []
    alternatives = (DynamicTree(1), DynamicTree(4))
    graph = calibration.graph_profile(model, heads, DynamicTree(2), [BF16, FP32], notices.append, alternatives)
    assert "2 more tree sizes captured" in notices[0]
    assert {(tokens, dtype, captured) for tokens, dtype, captured in runs if tokens in (2, 5)} == {(2, FP32, True),
                                                                                            (5, FP32, True)}
    # with the fastest plain step, in the same rounds
    assert set(graph.sizes_ms) == {1, 2, 3, 5} and graph.sizes_ms[5] < 12.0 <= graph.sizes_ms[3]  # ms per step
    assert runs.count((1, FP32, True)) == 2
    runs.clear()
    assert calibration.graph_profile(model, heads, DynamicTree(2), [BF16, FP32], notices.append, alternatives) == graph
    assert runs == [] and len(notices) == 1
    # without alternatives, or where eager steps are the fastest, no other size is timed
    assert calibration.graph_profile(model, heads, DynamicTree(2), [BF16, FP32], notices.append).sizes_ms == {}
    runs.clear()
    assert calibration.graph_profile(model, heads, DynamicTree(2), [BF16], notices.append, alternatives).sizes_ms == {}
    assert {tokens for tokens, _, _ in runs} == {1, 3}


def test_eager_and_captured_timings_taken_while_other_processes_were_busy_serve_this_run_only(
        tiny_pangu, quick_calibration, monkeypatch):
    """A neighbour's load while either timing ran (the dtypes' steps, or the tree sizes') would be kept as this
    machine's costs for every later run."""
    model = tiny_pangu[1]
    monkeypatch.setattr(calibration, "busy", busy)

    def captured_faster(model, calls, tree=None, heads=None, context=calibration.CONTEXT, captured=False):
        return lambda: time.sleep(0.002 if captured else 0.004)

    monkeypatch.setattr(calibration, "step_runner", captured_faster)
    shares = iter([0.0, 0.5, 0.0, 0.0])  # the steps' timing quiet, the tree sizes' busy; then both quiet

    class Meter:
        share = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.share = next(shares)

    monkeypatch.setattr(calibration, "LoadMeter", Meter)
    heads = random_heads(model, num_heads=2, head_input="hidden_and_path")
    notices = []
    alternatives = (DynamicTree(4),)
    graph = calibration.graph_profile(model, heads, DynamicTree(2), [FP32], notices.append, alternatives)
    assert set(graph.sizes_ms) == {1, 3, 5}
    assert any(line.startswith("Not keeping the eager/captured timings") and "took 50% of the CPU time" in line
               for line in notices)
    assert not any(calibration.calibration_dir().glob("*.json"))
    calibration.graph_profile(model, heads, DynamicTree(2), [FP32], notices.append, alternatives)
    assert len(list(calibration.calibration_dir().glob("*.json"))) == 1
