"""The phase split of `benchmark.py --profile_phases`: every phase a step runs is timed, the phases add up to
the decode's time, and timing them changes no token and no captured graph."""

import json

import pytest
import torch

from inference import benchmark
from inference.engine.decoding import DecodeRequest, DecodeStats
from inference.engine.graph_mode import graphs_compiled
from inference.engine.medusa_decoding import MedusaDecoder
from inference.engine.phases import ACCEPTANCE, CAPTURED, DRAFTING, FORWARD, HOST, PhaseClock
from inference.engine.plain_decoding import PlainDecoder
from medusa_choices import load_tree
from medusa_helpers import random_heads, random_prompts
from medusa_model import save_heads

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def prompt(tiny_pangu):
    return random_prompts(tiny_pangu[1].config.vocab_size, count=1, seed=5)[0] * 3


def profiled(decode) -> tuple[list[int], DecodeStats, float]:
    """(ids, stats with phases, seconds after the first token) of one decode, timed as the benchmark does."""
    ids, stats, _, decode_seconds = benchmark.timed(decode, CPU, profile=True)
    return ids, stats, decode_seconds


def unprofiled(decode) -> list[int]:
    return [t for step in decode(DecodeStats()) for t in step]


def assert_phases_cover(phases: PhaseClock, decode_seconds: float, expected: set[str]) -> None:
    assert set(phases.seconds) == expected and all(s > 0 for s in phases.seconds.values())
    assert sum(phases.seconds.values()) == pytest.approx(decode_seconds, rel=0.15)


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "dynamic:16"])
def test_an_eager_medusa_step_splits_into_drafting_forward_acceptance_and_host(tiny_pangu, prompt, tree):
    model = tiny_pangu[1]
    decoder = MedusaDecoder(model, random_heads(model, std=0.3))

    def decode(stats):
        return decoder.decode(DecodeRequest(prompt, 48), load_tree(tree), stats=stats)

    ids, stats, seconds = profiled(decode)
    assert_phases_cover(stats.phases, seconds, {DRAFTING, FORWARD, ACCEPTANCE, HOST})
    assert ids == unprofiled(decode)


def test_an_eager_plain_step_splits_into_forward_and_host(tiny_pangu, prompt):
    decoder = PlainDecoder(tiny_pangu[1])

    def decode(stats):
        return decoder.decode(DecodeRequest(prompt, 48), stats)

    ids, stats, seconds = profiled(decode)
    assert_phases_cover(stats.phases, seconds, {FORWARD, HOST})
    assert ids == unprofiled(decode)


def test_a_captured_step_is_one_phase_and_timing_it_recompiles_nothing(tiny_pangu, prompt):
    model = tiny_pangu[1]
    medusa = MedusaDecoder(model, random_heads(model, std=0.3), compile=True)
    plain = PlainDecoder(model, compile=True)
    sides = [lambda stats: medusa.decode(DecodeRequest(prompt, 48), load_tree("mc_sim_7b_63"), stats=stats),
             lambda stats: plain.decode(DecodeRequest(prompt, 48), stats)]
    expected = [unprofiled(decode) for decode in sides]  # compiles both steps
    before = graphs_compiled()
    for decode, ids in zip(sides, expected):
        out, stats, seconds = profiled(decode)
        assert_phases_cover(stats.phases, seconds, {CAPTURED, HOST})
        assert out == ids
    assert graphs_compiled() == before


def test_the_benchmark_reports_each_sides_phases_beside_its_measured_step_time(tiny_pangu, tmp_path, capsys):
    directory, model = tiny_pangu
    save_heads(random_heads(model, num_heads=4), tmp_path / "heads")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    out = tmp_path / "bench.json"
    assert benchmark.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"),
                           "--medusa_choices", "tree_16", "--prompts", str(prompts), "--max_new_tokens", "24",
                           "--runs", "1", "--dtype", "fp32", "--ignore_eos", "--compile", "off", "--profile_phases",
                           "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    medusa, plain = results["phases"]["medusa"], results["phases"]["fp32"]
    assert set(medusa["phases"]) == {DRAFTING, FORWARD, ACCEPTANCE, HOST} and set(plain["phases"]) == {FORWARD, HOST}
    assert medusa["steps"] == sum(r["medusa_steps"] for r in results["rows"]) and plain["steps"] == 2 * 23
    for split in (medusa, plain):
        assert sum(split["phases"].values()) == pytest.approx(split["ms_per_step"], rel=0.15)
    table = capsys.readouterr().out
    assert "phases medusa: drafting" in table and "phases fp32: forward" in table
