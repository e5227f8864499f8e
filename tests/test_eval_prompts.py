"""Evaluation prompt sets: the slices a command names, readable by the benchmark."""

import json

from inference import eval_prompts
from inference.benchmark import load_benchmark_prompts


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def mt_bench(tmp_path):
    questions = [{"question_id": i, "category": category, "turns": [f"{category} {i}", "follow-up"]}
                 for i, category in enumerate(["writing"] * 4 + ["math"] * 4)]
    return write_jsonl(tmp_path / "mt_bench.jsonl", questions)


def test_mt_bench_slices_take_each_categorys_questions_in_order_and_do_not_overlap(tmp_path):
    path = mt_bench(tmp_path)
    first = eval_prompts.mt_bench_prompts(path, count=2)
    second = eval_prompts.mt_bench_prompts(path, count=5, skip=2)
    assert [p["prompt"] for p in first] == ["writing 0", "writing 1", "math 4", "math 5"]
    assert [p["prompt"] for p in second] == ["writing 2", "writing 3", "math 6", "math 7"]
    assert {p["category"] for p in first} == {"writing", "math"}


def test_the_command_writes_a_set_the_benchmark_reads(tmp_path):
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": f"q{i}", "answer": "#### 1"} for i in range(5)])
    out = tmp_path / "eval.jsonl"
    argv = ["--mt_bench", mt_bench(tmp_path), "--per_category", "1", "--builtin", "--gsm8k", gsm8k,
            "--gsm8k_count", "2", "--gsm8k_skip", "1", "--out", str(out)]
    assert eval_prompts.main(argv) == 0
    prompts = load_benchmark_prompts(str(out), None)
    builtin = load_benchmark_prompts(None, None)
    assert [p["prompt"] for p in prompts[:2]] == ["writing 0", "math 4"]
    assert prompts[2 : 2 + len(builtin)] == builtin
    assert [(p["category"], p["prompt"]) for p in prompts[2 + len(builtin) :]] == [("gsm8k", "q1"), ("gsm8k", "q2")]


def test_bad_input_is_one_error_line(tmp_path, capsys):
    out = str(tmp_path / "eval.jsonl")
    assert eval_prompts.main(["--out", out]) == 2
    assert "no prompts chosen" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"category": "writing"}\n')
    assert eval_prompts.main(["--mt_bench", str(broken), "--out", out]) == 2
    assert "broken.jsonl:1 needs the fields category, turns" in capsys.readouterr().err
    assert eval_prompts.main(["--gsm8k", str(tmp_path / "missing.jsonl"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err
