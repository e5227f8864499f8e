import json
import time

import torch

from inference import benchmark
from inference.engine import step_schedule
from medusa_helpers import random_heads
from medusa_model import save_heads

TOP_KEYS = {"speedup", "tokens_per_step", "overhead", "outputs_identical", "baseline_tokens_per_second",
            "medusa_tokens_per_second", "by_length"}


def test_benchmark_writes_json_table_and_plot_with_captured_steps_timed_apart_from_compiling(tiny_pangu, tmp_path,
                                                                                            capsys):
    directory, model = tiny_pangu
    save_heads(random_heads(model, num_heads=4), tmp_path / "heads")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one", "category": "chat"}\n{"prompt": "two", "category": "code"}\n'
                       '{"turns": ["three", "ignored"], "category": "code"}\n')
    out = tmp_path / "bench.json"
    code = benchmark.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"),
                           "--medusa_choices", "tree_16", "--prompts", str(prompts), "--max_new_tokens", "8,24",
                           "--runs", "2", "--dtype", "fp32", "--ignore_eos", "--compile", "on", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert TOP_KEYS <= set(results)
    assert [r["max_new_tokens"] for r in results["by_length"]] == [8, 24]
    assert all(TOP_KEYS - {"by_length"} <= set(r) for r in results["by_length"])
    assert results["outputs_identical"] == 1.0
    assert results["new_tokens"] == 3 * (8 + 24)  # --ignore_eos: every prompt runs to the limit
    assert {r["category"] for r in results["by_category"]} == {"chat", "code"}
    assert out.with_suffix(".png").stat().st_size > 1000
    config = results["config"]
    assert (config["medusa_dtype"], config["tree_tokens"], config["graph_mode"]) == ("fp32", 17, "captured")
    assert set(config["plain_tokens_per_second"]) == {"fp32", "fp32 captured"}
    assert config["baseline_dtype"] in config["plain_tokens_per_second"]
    # each captured side compiled once, and no rate counts that time
    assert config["compile_seconds"]["medusa"] > 0 and config["compile_seconds"]["fp32 captured"] > 0
    assert config["compile_seconds"]["fp32"] == 0
    medusa_seconds = sum(r["medusa_seconds"] for r in results["rows"])
    assert medusa_seconds < config["compile_seconds"]["medusa"]
    assert "threads" in config["hardware"] and "torch" in config["hardware"]
    table = capsys.readouterr().out
    assert "speedup" in table and "overhead" in table and "category" in table and config["hardware"] in table


def test_each_side_is_rated_on_its_own_tokens_and_time():
    row = {"max_new_tokens": 32, "category": "chat", "identical": False, "medusa_steps": 5,
           "tokens": 20, "medusa_seconds": 1.0, "medusa_decode_seconds": 0.9,
           "baseline_tokens": 10, "baseline_seconds": 1.0, "baseline_decode_seconds": 0.9,
           "medusa_step_sizes": {"1": 2, "9": 3}, "medusa_switches": 1}
    assert benchmark.summarise([row, row | {"medusa_step_sizes": {"13": 5}}])["step_sizes"] == {"1": 2, "9": 3, "13": 5}
    summary = benchmark.summarise([row])
    assert summary["medusa_tokens_per_second"] == 20 and summary["baseline_tokens_per_second"] == 10
    assert summary["speedup"] == 2.0 and summary["tokens_per_step"] == 19 / 5
    assert summary["ms_per_plain_token"] == 100.0  # 0.9 s over the baseline's own 9 decode-phase tokens


def test_a_compile_before_the_first_token_is_left_out_of_the_total_and_not_charged_to_the_decode_phase():
    def decode(stats):
        time.sleep(0.3)  # a step compiled before the first token
        stats.compile_seconds += 0.3
        yield [1]
        time.sleep(0.05)
        yield [2]

    _, _, total, decode_phase = benchmark.timed(decode, torch.device("cpu"))
    assert 0.04 < decode_phase < 0.2 and 0.04 < total < 0.2


def test_sharegpt_file_uses_first_human_turn(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
                                {"conversations": [{"from": "gpt", "value": "skip"}]}]))
    assert benchmark.load_benchmark_prompts(str(path), None) == [{"prompt": "hi", "category": "sharegpt"}]


def test_by_default_medusa_at_its_choice_runs_against_the_fastest_plain_dtype_of_the_run(tiny_pangu, tmp_path,
                                                                                         monkeypatch):
    import medusa_model
    from inference.runtime.calibration import StepProfile

    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=2)
    heads.config.medusa_head_accuracy = [[0.6, 0.2], [0.5, 0.1]]
    save_heads(heads, tmp_path / "heads")
    # plain is fastest in bf16, while fp32 tree steps are flat: Medusa in fp32 beats it
    profile = StepProfile({torch.bfloat16: 10.0, torch.float32: 12.0},
                          {torch.bfloat16: {2: 20.0, 5: 50.0}, torch.float32: {2: 12.5, 5: 13.0}})
    monkeypatch.setattr(medusa_model, "step_profile", lambda *args: profile)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n')
    out = tmp_path / "bench.json"
    assert benchmark.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"), "--prompts",
                           str(prompts), "--max_new_tokens", "8", "--runs", "1", "--ignore_eos", "--compile", "off",
                           "--out", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["medusa_dtype"] == "fp32" and config["tree_tokens"] > 1
    # plain decoding ran in both dtypes; the one faster in this run is the baseline
    rates = config["plain_tokens_per_second"]
    assert set(rates) == {"bf16", "fp32"} and config["baseline_dtype"] == max(rates, key=rates.get)
    # where plain decoding's dtypes are about as fast, the baseline can be measured in each
    assert benchmark.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"), "--prompts",
                           str(prompts), "--max_new_tokens", "8", "--runs", "1", "--ignore_eos", "--out", str(out),
                           "--baseline_dtype", "fp32", "--compile", "off"]) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["baseline_dtype"], config["medusa_dtype"]) == ("fp32", "fp32")
    assert config["step_options"][0] == config["tree_tokens"] and config["step_options"][-1] == 1
    # the runtime's first choice at every step, to compare with the schedule's
    assert benchmark.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"), "--prompts",
                           str(prompts), "--max_new_tokens", "8", "--runs", "1", "--ignore_eos", "--out", str(out),
                           "--compile", "off", "--schedule", "fixed"]) == 0
    results = json.loads(out.read_text())
    assert list(results["step_sizes"]) == [str(results["config"]["tree_tokens"])] and results["switches"] == 0


def test_both_schedules_run_side_by_side_in_one_run_each_reported(tiny_pangu, tmp_path, monkeypatch, capsys):
    import medusa_model
    from inference.runtime.calibration import StepProfile

    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=2)
    heads.config.medusa_head_accuracy = [[0.6, 0.2], [0.5, 0.1]]
    save_heads(heads, tmp_path / "heads")
    # the profile says 5-token trees pay; the tiny model's real steps cost about the same whatever their size
    profile = StepProfile({torch.float32: 30.0}, {torch.float32: {2: 12.5, 5: 13.0}})
    monkeypatch.setattr(medusa_model, "step_profile", lambda *args: profile)
    # the tiny model's steps cost about the same whatever their size, so which option leads after the probes is
    # the clock's noise: probes long enough to outlast the warm-up make the timed runs' sizes deterministic
    monkeypatch.setattr(step_schedule, "PROBES", 16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    out = tmp_path / "bench.json"
    assert benchmark.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"), "--prompts",
                           str(prompts), "--max_new_tokens", "24", "--runs", "1", "--ignore_eos", "--out", str(out),
                           "--dtype", "fp32", "--compile", "off", "--schedule", "both"]) == 0
    results = json.loads(out.read_text())
    adaptive, fixed = results["by_schedule"]
    assert (adaptive["schedule"], fixed["schedule"]) == ("adaptive", "fixed")
    tree = results["config"]["tree_tokens"]
    assert list(fixed["step_sizes"]) == [str(tree)] and fixed["switches"] == 0
    assert len(adaptive["step_sizes"]) > 1  # the schedule probed its other options in the timed runs
    # the table's Medusa columns are the adaptive runs', the fixed runs were timed beside them
    assert {k: results[k] for k in ("speedup", "step_sizes")} == {k: adaptive[k] for k in ("speedup", "step_sizes")}
    assert fixed["medusa_tokens_per_second"] != adaptive["medusa_tokens_per_second"]
    assert adaptive["outputs_identical"] == fixed["outputs_identical"] == 1.0
    assert set(results["config"]["compile_seconds"]) == {"medusa", "medusa fixed", "fp32"}
    assert "schedule    fixed:" in capsys.readouterr().out


def test_both_schedules_need_a_per_step_choice(tiny_pangu, tmp_path):
    directory, model = tiny_pangu
    save_heads(random_heads(model, num_heads=2), tmp_path / "heads")
    assert benchmark.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"), "--max_new_tokens",
                           "8", "--runs", "1", "--dtype", "fp32", "--compile", "off", "--medusa_choices", "chain_2",
                           "--schedule", "both"]) == 2


def test_the_baseline_is_the_plain_dtype_fastest_over_all_prompts_together():
    rows = [{"plain": {"bf16": {"tokens": 10, "seconds": 1.0}, "fp32": {"tokens": 10, "seconds": 0.5}}},
            {"plain": {"bf16": {"tokens": 100, "seconds": 2.0}, "fp32": {"tokens": 100, "seconds": 4.0}}}]
    assert benchmark.fastest_baseline(benchmark.plain_rates(rows)) == "bf16"  # 110 tokens in 3 s against 4.5 s; fp32 won one prompt
