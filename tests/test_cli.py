"""The command lines: JSON output, prompt files, and one clear error line (no traceback) on bad input."""

import json

import pytest

from inference import generate, medusa_generate
from medusa_helpers import random_heads
from medusa_model import save_heads


def run(main, argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("main", [generate.main, medusa_generate.main])
def test_json_output_has_the_documented_fields(tiny_pangu, capsys, main):
    directory, _ = tiny_pangu
    code, out, err = run(main, ["--base_model", str(directory), "--prompt", "hello", "--max_new_tokens", "12",
                                "--dtype", "fp32", "--json", "--no_think"], capsys)
    assert code == 0, err
    record = json.loads(out)
    assert {"text", "token_ids", "new_tokens", "seconds", "tokens_per_second"} <= set(record)
    assert record["new_tokens"] == len(record["token_ids"]) <= 12
    assert "Model: " in err


def test_medusa_and_plain_cli_give_identical_tokens(tiny_pangu, tmp_path, capsys):
    directory, model = tiny_pangu
    save_heads(random_heads(model, num_heads=4), tmp_path / "heads")
    common = ["--base_model", str(directory), "--prompt", "The quick brown fox", "--max_new_tokens", "30",
              "--dtype", "fp32", "--json"]
    _, plain, _ = run(generate.main, common, capsys)
    code, medusa, err = run(medusa_generate.main, common + ["--medusa_dir", str(tmp_path / "heads"),
                                                            "--medusa_choices", "mc_sim_7b_63"], capsys)
    assert code == 0, err
    assert json.loads(medusa)["token_ids"] == json.loads(plain)["token_ids"]
    assert {"steps", "tokens_per_step", "accept_lengths"} <= set(json.loads(medusa))


def test_prompts_file_gives_one_result_per_line(tiny_pangu, tmp_path, capsys):
    directory, _ = tiny_pangu
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello", "id": 1}\n\n{"turns": ["hi", "and then?"], "id": 2}\n')
    code, out, err = run(generate.main, ["--base_model", str(directory), "--prompts", str(prompts),
                                         "--max_new_tokens", "5", "--json"], capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["id"] for line in lines] == [1, 2]
    assert "text" in lines[0] and len(lines[1]["turns"]) == 2


def test_stream_prints_the_same_text(tiny_pangu, capsys):
    directory, _ = tiny_pangu
    argv = ["--base_model", str(directory), "--prompt", "hello", "--max_new_tokens", "16", "--dtype", "fp32"]
    _, streamed, _ = run(generate.main, argv + ["--stream"], capsys)
    _, printed, _ = run(generate.main, argv, capsys)
    assert streamed.strip() == printed.strip()


def test_interactive_chat_clears_history_and_exits_on_eof(tiny_pangu, capsys, monkeypatch):
    directory, _ = tiny_pangu
    answers = iter(["hello", "/clear", "again"])

    def fake_input(prompt=""):
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    code, out, err = run(generate.main, ["--base_model", str(directory), "--interactive", "--max_new_tokens", "4"], capsys)
    assert code == 0
    assert "history cleared" in err and out.count("Assistant: ") == 2


def write_truncated_checkpoint(source, target):
    target.mkdir()
    for item in source.iterdir():
        data = item.read_bytes()
        (target / item.name).write_bytes(data[: len(data) // 2] if item.name.endswith("00002-of-00004.safetensors") else data)


COMMON_BAD_INPUT = [
    ("missing", "does not exist"),
    ("empty", "is empty"),
    ("not_causal", "not a causal language model"),
    ("truncated", "cannot load the model weights"),
    ("long_prompt", "exceeds the model's context"),
    ("device", "unknown device"),
    ("dtype", "unknown dtype"),
    ("bad_prompts", "needs a 'prompt'"),
]
BAD_INPUT = [(generate.main, *case) for case in COMMON_BAD_INPUT] + [
    (medusa_generate.main, *case) for case in COMMON_BAD_INPUT + [("bad_tree", "not prefix-closed")]
]


@pytest.mark.parametrize("main,case,message", BAD_INPUT, ids=[f"{m.__module__.split('.')[-1]}-{c}" for m, c, _ in BAD_INPUT])
def test_bad_input_is_one_clear_line_and_exit_2(tiny_pangu, tmp_path, capsys, main, case, message):
    directory, _ = tiny_pangu
    base = str(directory)
    extra: list[str] = []
    if case == "missing":
        base = str(tmp_path / "nope")
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        base = str(tmp_path / "empty")
    elif case == "not_causal":
        (tmp_path / "vision").mkdir()
        (tmp_path / "vision" / "config.json").write_text(json.dumps({"model_type": "vit"}))
        base = str(tmp_path / "vision")
    elif case == "truncated":
        write_truncated_checkpoint(directory, tmp_path / "truncated")
        base = str(tmp_path / "truncated")
    elif case == "long_prompt":
        extra = ["--prompt", "word " * 1200]
    elif case == "device":
        extra = ["--device", "tpu"]
    elif case == "dtype":
        extra = ["--dtype", "int3"]
    elif case == "bad_tree":
        (tmp_path / "tree.json").write_text("[[0], [1, 1]]")
        extra = ["--medusa_choices", str(tmp_path / "tree.json")]
    elif case == "bad_prompts":
        (tmp_path / "p.jsonl").write_text('{"text": "no prompt key"}\n')
        extra = ["--prompts", str(tmp_path / "p.jsonl")]
    code, out, err = run(main, ["--base_model", base, "--max_new_tokens", "8", *extra], capsys)
    assert code == 2
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert "Traceback" not in err
