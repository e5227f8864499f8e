"""The command lines: JSON output, prompt files, and one clear error line (no traceback) on bad input."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference import generate, medusa_generate
from inference.engine.plain_decoding import PlainDecoder
from inference.runtime.console import to_stderr
from medusa_helpers import random_heads, upper_half_vocab
from medusa_model import save_heads


def run(main, argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # what argparse does with a bad argument
        code = exit_.code
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


def test_a_notice_while_an_answer_streams_starts_a_line_of_its_own(tiny_pangu, monkeypatch):
    """Both streams on one terminal: a notice from inside the decode (a compile, the schedule switching sizes) does
    not land inside the streamed sentence."""
    notice = "Compiling the plain step"

    class NoticeAfterEveryStep(PlainDecoder):
        def decode(self, request, stats=None):
            for step in super().decode(request, stats):
                yield step
                to_stderr(notice)

    monkeypatch.setattr(generate, "PlainDecoder", NoticeAfterEveryStep)
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert generate.main(["--base_model", str(tiny_pangu[0]), "--prompt", "hello", "--max_new_tokens", "16",
                          "--dtype", "fp32", "--compile", "off", "--stream"]) == 0
    lines = terminal.getvalue().splitlines()
    assert lines.count(notice) >= 2 and all(line == notice for line in lines if notice in line)
    assert lines[-1].startswith("[")  # the rate, on a line of its own after the answer


def test_a_compile_at_the_first_step_is_said_before_the_answer_starts(tiny_pangu, monkeypatch):
    """A captured step compiles at its first call, after the prefill's token: that token waits for the first step's,
    so the notice does not split the answer's first line."""
    notice = "Compiling the plain step"

    class CompilesAtTheFirstStep(PlainDecoder):
        def decode(self, request, stats=None):
            steps = super().decode(request, stats)
            yield next(steps)
            to_stderr(notice)
            yield from steps

    class Stdout:
        """Writes to the shared terminal, noting where the answer's first character landed."""
        first = None

        def write(self, text):
            if text and self.first is None:
                self.first = terminal.tell()
            return terminal.write(text)

        def flush(self):
            pass

    monkeypatch.setattr(generate, "PlainDecoder", CompilesAtTheFirstStep)
    terminal, stdout = io.StringIO(), Stdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert generate.main(["--base_model", str(tiny_pangu[0]), "--prompt", "hello", "--max_new_tokens", "16",
                          "--dtype", "fp32", "--compile", "off", "--stream"]) == 0
    assert stdout.first is not None and terminal.getvalue().index(notice) < stdout.first


def test_the_summary_line_says_how_much_of_the_time_compiled_and_that_the_rate_leaves_it_out(tiny_pangu, capsys,
                                                                                              monkeypatch):
    class CompilesForTwoSeconds(PlainDecoder):
        def decode(self, request, stats=None):
            steps = super().decode(request, stats)
            yield next(steps)
            stats.compile_seconds += 2.0
            yield from steps

    argv = ["--base_model", str(tiny_pangu[0]), "--prompt", "hello", "--max_new_tokens", "4", "--dtype", "fp32",
            "--compile", "off"]
    _, _, eager = run(generate.main, argv, capsys)
    monkeypatch.setattr(generate, "PlainDecoder", CompilesForTwoSeconds)
    _, _, compiled = run(generate.main, argv, capsys)
    assert "compiling" not in eager and "(2.0 s of it compiling, left out of the rate), " in compiled


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`generate.py --json ... | head -1`: the closed pipe is a quiet stop with the status a shell gives, not a
    traceback."""
    writes_forever = ("import sys; from inference.runtime.errors import run_command; "
                      "sys.exit(run_command(lambda: [print('x' * 80, flush=True) for _ in range(10**7)]))")
    process = subprocess.Popen([sys.executable, "-c", writes_forever], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=Path(__file__).parents[1])
    process.stdout.read(100)
    process.stdout.close()
    errors = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141 and errors == ""


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
    ("dtype", "invalid choice: 'int3'"),
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


def command(name):
    """The main() of a command line by its module name (imported here: train/ needs its extras only when run)."""
    import importlib

    return importlib.import_module(name).main


ARGUMENT_ERRORS = [
    ("inference.medusa_generate", ["--temperature", "nan"], "nan is not a finite number >= 0"),
    ("inference.medusa_generate", ["--temperature", "inf"], "is not a finite number >= 0"),
    ("inference.medusa_generate", ["--temperature", "-1"], "-1 is not a finite number >= 0"),
    ("inference.generate", ["--top_p", "0"], "0 is not in (0, 1]"),
    ("inference.generate", ["--top_p", "2"], "2 is not in (0, 1]"),
    ("inference.generate", ["--max_new_tokens", "0"], "0 is not a positive integer"),
    ("inference.generate", ["--prompt", "   "], "--prompt is empty"),
    ("inference.medusa_generate", ["--posterior_threshold", "-1"], "is not a finite number >= 0"),
    ("inference.medusa_generate", ["--acceptance", "exact"], "invalid choice: 'exact'"),
    ("inference.benchmark", ["--num_prompts", "0"], "0 is not a positive integer"),
    ("inference.benchmark", ["--num_prompts", "-1"], "-1 is not a positive integer"),
    ("inference.benchmark", ["--runs", "two"], "'two' is not an integer"),
    ("inference.eval_prompts", [], "the following arguments are required: --out"),
    ("inference.convert_medusa", ["--out", "x"], "the following arguments are required: --layout"),
    ("train.gen_distill_data", ["--out", "x.jsonl", "--temperature", "-1"], "-1 is not a finite number >= 0"),
    ("train.gen_distill_data", ["--out", "x.jsonl", "--batch_size", "0"], "0 is not a positive integer"),
    ("train.train_medusa", ["--data", "d", "--out", "o", "--eval_fraction", "1.5"], "1.5 is not in [0, 1)"),
    ("train.train_medusa", ["--data", "d", "--out", "o", "--num_heads", "0"], "0 is not a positive integer"),
    ("train.medusa_tree_builder", ["--heads", "h", "--data", "d", "--out", "o", "--top_k", "0"],
     "0 is not a positive integer"),
    ("train.export_checkpoint", [], "the following arguments are required"),
]


@pytest.mark.parametrize("module,argv,message", ARGUMENT_ERRORS,
                         ids=[f"{m.split('.')[-1]}-{' '.join(a)}" for m, a, _ in ARGUMENT_ERRORS])
def test_a_bad_argument_is_one_error_line_without_a_usage_block(capsys, module, argv, message):
    with pytest.raises(SystemExit) as exit_:
        command(module)(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


COMMANDS = ["inference.generate", "inference.medusa_generate", "inference.benchmark", "inference.eval_prompts",
            "inference.convert_medusa", "train.gen_distill_data", "train.train_medusa", "train.train_feature_drafter",
            "train.medusa_tree_builder", "train.export_checkpoint", "train.draft_vocab", "train.lookup_accuracy"]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_names_each_default_once(capsys, module):
    with pytest.raises(SystemExit):
        command(module)(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    for option in text.split(" --")[1:]:
        assert option.lower().count("default:") <= 1, option


def bad_heads(tmp_path, model, case: str) -> str:
    """A heads directory broken in one way."""
    heads = tmp_path / "heads"
    save_heads(random_heads(model, num_heads=2), heads)
    config = json.loads((heads / "config.json").read_text())
    fields = {"heads_as_text": {"medusa_num_heads": "5"}, "heads_as_float": {"medusa_num_heads": 5.0},
              "layers_as_word": {"medusa_num_layers": "two"}, "empty_accuracy": {"medusa_head_accuracy": []},
              "text_accuracy": {"medusa_head_accuracy": "abc"}, "tree_as_number": {"medusa_choices": 3}}
    if case in fields:
        (heads / "config.json").write_text(json.dumps(config | fields[case]))
    elif case == "truncated_pt":
        torch.save(random_heads(model, num_heads=2).state_dict(), heads / "medusa_lm_head.pt")
        (heads / "medusa_lm_head.safetensors").unlink()
        data = (heads / "medusa_lm_head.pt").read_bytes()
        (heads / "medusa_lm_head.pt").write_bytes(data[: len(data) // 2])
    elif case == "truncated_safetensors":
        data = (heads / "medusa_lm_head.safetensors").read_bytes()
        (heads / "medusa_lm_head.safetensors").write_bytes(data[: len(data) // 2])
    return str(heads)


BAD_HEADS = [("heads_as_text", "medusa_num_heads must be an integer"),
             ("heads_as_float", "medusa_num_heads must be an integer"),
             ("layers_as_word", "medusa_num_layers must be an integer"),
             ("empty_accuracy", "medusa_head_accuracy must be a non-empty list"),
             ("text_accuracy", "medusa_head_accuracy must be a non-empty list"),
             ("tree_as_number", "medusa_choices must be a tree name or a list"),
             ("truncated_pt", "medusa_lm_head.pt is unreadable"),
             ("truncated_safetensors", "medusa_lm_head.safetensors is unreadable")]


@pytest.mark.parametrize("case,message", BAD_HEADS, ids=[case for case, _ in BAD_HEADS])
def test_broken_heads_are_one_clear_line(tiny_pangu, tmp_path, capsys, case, message):
    directory, model = tiny_pangu
    code, out, err = run(medusa_generate.main, ["--base_model", str(directory), "--medusa_dir",
                                                bad_heads(tmp_path, model, case), "--dtype", "fp32"], capsys)
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(error_lines) == 1 and message in error_lines[0], err
    assert "Traceback" not in err


BAD_TREES_AND_PROMPTS = [
    (["--medusa_choices", "TREE:[[300]]"], "top 301 proposals, but they rank only 197 tokens"),
    (["--medusa_choices", "dynamic:8:lookup=999"], "does not fit in 8 nodes"),
    (["--medusa_choices", "TREE:[[true], [false]]"], "is not a non-empty list of non-negative integer ranks"),
    (["--prompts", "PROMPTS:{\"turns\": [null, 3]}"], "every prompt and turn must be a non-empty string"),
    (["--prompts", "PROMPTS:{\"prompt\": \"  \"}"], "every prompt and turn must be a non-empty string"),
]


@pytest.mark.parametrize("extra,message", BAD_TREES_AND_PROMPTS, ids=[" ".join(e) for e, _ in BAD_TREES_AND_PROMPTS])
def test_bad_trees_and_prompt_files_are_one_clear_line(tiny_pangu, tmp_path, capsys, extra, message):
    directory, model = tiny_pangu
    heads = tmp_path / "heads"
    save_heads(random_heads(model, num_heads=2, head_input="hidden_and_path", draft_vocab=upper_half_vocab(model)), heads)
    argv = []
    for value in extra:
        kind, _, content = value.partition(":")
        if kind in ("TREE", "PROMPTS"):
            value = str(tmp_path / ("tree.json" if kind == "TREE" else "prompts.jsonl"))
            Path(value).write_text(content + "\n")
        argv.append(value)
    code, out, err = run(medusa_generate.main, ["--base_model", str(directory), "--medusa_dir", str(heads),
                                                "--dtype", "fp32", "--max_new_tokens", "4", *argv], capsys)
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(error_lines) == 1 and message in error_lines[0], err


def base_model_copy(directory, target):
    target.mkdir()
    (target / "config.json").write_text((directory / "config.json").read_text())
    return target


OUT_ERRORS = [
    ("inference.benchmark", ["--out", "DIR"], "is a directory; a file name was expected"),
    ("inference.benchmark", ["--out", "FILE/x.json"], "is a file, not a directory"),
    ("inference.eval_prompts", ["--builtin", "--out", "DIR"], "is a directory; a file name was expected"),
    ("inference.convert_medusa", ["--layout", "heads", "--out", "BASE"], "holds a base model"),
    ("inference.convert_medusa", ["--layout", "vllm", "--out", "FILE"], "is a file; a directory was expected"),
    ("train.train_medusa", ["--data", "d.jsonl", "--out", "FILE"], "is a file; a directory was expected"),
    ("train.train_medusa", ["--data", "d.jsonl", "--out", "BASE"], "holds a base model"),
    ("train.gen_distill_data", ["--out", "DIR"], "is a directory; a file name was expected"),
    ("train.medusa_tree_builder", ["--heads", "h", "--data", "d.jsonl", "--out", "DIR"], "is a directory"),
    ("train.export_checkpoint", ["--checkpoint", "c", "--out", "BASE"], "holds a base model"),
]


@pytest.mark.parametrize("module,argv,message", OUT_ERRORS, ids=[f"{m.split('.')[-1]}-{' '.join(a)}" for m, a, _ in OUT_ERRORS])
def test_an_output_that_cannot_or_must_not_be_written_is_refused_before_any_work(tiny_pangu, tmp_path, capsys,
                                                                                module, argv, message):
    (tmp_path / "FILE").write_text("")
    (tmp_path / "DIR").mkdir()
    base_model_copy(tiny_pangu[0], tmp_path / "BASE")
    argv = [str(tmp_path / a) if a.split("/")[0] in ("FILE", "DIR", "BASE") else a for a in argv]
    code, out, err = run(command(module), ["--base_model", str(tiny_pangu[0])] * module.startswith(("inference.bench",
                                                                                                   "inference.conv"))
                         + argv, capsys)
    assert code == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "BASE" / "config.json").read_text() == (tiny_pangu[0] / "config.json").read_text()


def test_distillation_past_the_context_is_refused_before_it_starts(tiny_pangu, tmp_path, capsys):
    code, out, err = run(command("train.gen_distill_data"), ["--base_model", str(tiny_pangu[0]), "--out",
                                                             str(tmp_path / "d.jsonl"), "--max_prompt_tokens", "100000",
                                                             "--dtype", "fp32"], capsys)
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(error_lines) == 1 and "exceeds the model's context" in error_lines[0]
    assert not (tmp_path / "d.jsonl").exists()


def test_an_unwritable_home_is_one_line_before_the_demo_model_is_converted(tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("OPENPANGU_MEDUSA_HOME", str(tmp_path / "a_file" / "home"))
    code, out, err = run(generate.main, ["--prompt", "hi"], capsys)
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(error_lines) == 1 and "cannot prepare the demo model" in error_lines[0]
    assert "OPENPANGU_MEDUSA_HOME" in error_lines[0] and "Preparing" not in err
