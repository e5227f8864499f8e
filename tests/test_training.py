"""The head-training pipeline: prompt sources, distillation data, targets, training, tree building."""

import gzip
import json
import logging
import os
import signal
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from inference import medusa_generate
from inference.engine.decoding import DecodeRequest
from inference.engine.medusa_decoding import MedusaDecoder
from inference.runtime.errors import UserError
from inference.runtime.loading import load_causal_lm
from inference.runtime.outputs import exclusive
from inference.runtime.feature_drafter import FeatureDrafter
from inference.runtime.medusa_heads import MedusaHeads
from medusa_choices import load_tree, validate_tree
from medusa_helpers import fit_heads, plain_greedy, random_heads, random_prompts
from medusa_model import load_heads, save_heads
from train import (distilled_answers, draft_vocab, export_checkpoint, features_cache, gen_distill_data,
                   medusa_tree_builder, train_feature_drafter, train_medusa)
from train import medusa_training
from train.medusa_training import (IGNORE, CachedPositions, MedusaTrainingModule, cache_hidden_states, distinct,
                                   head_targets, most_frequent_tokens, read_samples, soft_cross_entropy)
from train.feature_drafter_training import base_features
from train.prompt_sources import iter_humaneval, iter_sharegpt, iter_sharegpt_later_turns


def test_truncated_sharegpt_file_yields_every_complete_conversation(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
               for i in range(3)]
    text = json.dumps(records)
    (tmp_path / "sg.json").write_text(text[: text.rindex('{"id": "2"') + 25])  # cut inside the last record
    assert list(iter_sharegpt(tmp_path / "sg.json")) == ["q0", "q1"]


def test_later_sharegpt_turns_are_every_human_turn_but_the_opening_ones(tmp_path):
    def turn(speaker, text):
        return {"from": speaker, "value": text}
    conversations = [[turn("human", "q0"), turn("gpt", "a"), turn("human", "q0 again"), turn("gpt", "b")],
                     [turn("gpt", "hello"), turn("human", "q1"), turn("human", " ")],
                     [turn("human", "q2"), turn("gpt", "a"), turn("human", "q2 again")]]
    text = json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(conversations)])
    (tmp_path / "sg.json").write_text(text[: text.rindex('{"id": "2"') + 40])  # the last one is truncated
    assert list(iter_sharegpt(tmp_path / "sg.json")) == ["q0"]
    assert list(iter_sharegpt_later_turns(tmp_path / "sg.json")) == ["q0 again", "q1"]


def test_humaneval_tasks_become_requests_to_complete_the_function(tmp_path):
    tasks = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n"} for i in range(2)]
    with gzip.open(tmp_path / "HumanEval.jsonl.gz", "wt") as file:
        file.write("".join(json.dumps(t) + "\n" for t in tasks))
    prompts = list(iter_humaneval(tmp_path / "HumanEval.jsonl.gz"))
    assert len(prompts) == 2 and prompts[1].startswith("Complete this Python function")
    assert tasks[1]["prompt"] in prompts[1]


def test_head_targets_skip_the_prompt_and_shift_per_head():
    targets = head_targets(prompt_len=3, ids=[10, 11, 12, 13, 14, 15], num_heads=2)
    # position t predicts ids[t+2+i]; only t >= prompt_len-1 = 2 counts
    assert targets[:2].eq(IGNORE).all()
    assert targets[2].tolist() == [14, 15] and targets[3].tolist() == [15, IGNORE]
    assert targets[4:].eq(IGNORE).all()


def _killed_mid_write(self, *args, **kwargs):
    self.open("w").close()  # the file is truncated, then the process dies
    raise KeyboardInterrupt


def _killed(*args):
    raise KeyboardInterrupt


@pytest.mark.parametrize("owner,name,kill", [(Path, "write_text", _killed_mid_write), (os, "replace", _killed)],
                         ids=["mid-write", "before-the-rename"])
def test_a_kill_while_resume_rewrites_the_data_loses_no_sample(tmp_path, monkeypatch, owner, name, kill):
    records = [{"index": i, "prompt_ids": [1, 2], "output_ids": [3, 4, 5], "text": str(i)} for i in range(3)]
    complete = "".join(json.dumps(r) + "\n" for r in records)
    path = tmp_path / "data.jsonl"
    path.write_text(complete + '{"index": 3, "prompt_ids": [1,', encoding="utf-8")  # torn by an earlier kill
    original = path.read_text(encoding="utf-8")
    with monkeypatch.context() as patch:
        patch.setattr(owner, name, kill)
        with pytest.raises(KeyboardInterrupt):
            gen_distill_data.done_indices(path)
    assert path.read_text(encoding="utf-8") == original
    assert gen_distill_data.done_indices(path) == {0, 1, 2}
    assert path.read_text(encoding="utf-8") == complete


def test_records_with_unicode_line_separators_are_read_whole_and_kept_on_resume(tmp_path):
    records = [{"index": i, "prompt_ids": [1, 2], "output_ids": [3, 4, 5], "text": f"line\u2028break\x85{i}"}
               for i in range(3)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert len(read_samples(path)) == 3
    assert gen_distill_data.done_indices(path) == {0, 1, 2}
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line] == records


def test_malformed_and_empty_data_are_clear_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt_ids": [1]}\n')
    with pytest.raises(UserError, match="bad.jsonl:1"):
        read_samples(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no usable samples"):
        read_samples(tmp_path / "empty.jsonl")


@pytest.fixture(scope="module")
def distilled(tiny_pangu, tmp_path_factory):
    directory, _ = tiny_pangu
    root = tmp_path_factory.mktemp("distill")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question number {i} about fox"}) + "\n" for i in range(12)))
    out = root / "data.jsonl"
    common = ["--base_model", str(directory), "--prompts", str(prompts), "--out", str(out), "--max_new_tokens", "24",
              "--batch_size", "4", "--dtype", "fp32"]
    assert gen_distill_data.main(common + ["--max_samples", "5"]) == 0
    with out.open("a") as file:
        file.write('{"index": 99, "prompt_ids": [1, 2')  # a torn last line, as after a kill mid-write
    assert gen_distill_data.main(common + ["--max_samples", "10"]) == 0
    return directory, out


def test_distillation_resumes_without_losing_or_duplicating(distilled, tiny_pangu):
    directory, out = distilled
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(10))
    model = tiny_pangu[1]
    first = records[0]
    with torch.no_grad():
        logits = model(torch.tensor([first["prompt_ids"] + first["output_ids"]])).logits[0]
    # stored ids are the model's own greedy continuation, exactly
    start = len(first["prompt_ids"]) - 1
    assert logits[start : start + len(first["output_ids"])].argmax(-1).tolist() == first["output_ids"]


def test_distillation_takes_prompts_from_skip_up_to_stop_only(distilled, tmp_path):
    directory, data = distilled
    out = tmp_path / "range.jsonl"
    assert gen_distill_data.main(["--base_model", str(directory), "--prompts", str(data.parent / "prompts.jsonl"),
                                  "--out", str(out), "--skip", "2", "--stop", "5", "--max_samples", "10",
                                  "--max_new_tokens", "4", "--dtype", "fp32"]) == 0
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [2, 3, 4]


def test_distillation_range_past_the_last_prompt_is_an_error(distilled, tmp_path, capsys):
    directory, data = distilled
    out = tmp_path / "heldout.jsonl"
    assert gen_distill_data.main(["--base_model", str(directory), "--prompts", str(data.parent / "prompts.jsonl"),
                                  "--out", str(out), "--skip", "12", "--max_new_tokens", "4", "--dtype", "fp32"]) == 2
    assert "no prompts from index 12" in capsys.readouterr().err and not out.exists()


def test_vllm_distillation_without_the_vllm_environment_says_how_to_make_it(distilled, tmp_path, monkeypatch, capsys):
    directory, data = distilled
    monkeypatch.setattr(gen_distill_data, "ROOT", tmp_path)  # a checkout without .venv-vllm
    out = tmp_path / "answers.jsonl"
    assert gen_distill_data.main(["--engine", "vllm", "--base_model", str(directory), "--prompts",
                                  str(data.parent / "prompts.jsonl"), "--out", str(out), "--max_samples", "2"]) == 2
    assert "make vllm-setup" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("stopped_before_the_batch", [False, True])
def test_a_vllm_that_stops_is_a_clear_error_with_its_last_log_line(distilled, tmp_path, monkeypatch, capsys,
                                                                    stopped_before_the_batch):
    directory, data = distilled
    fake = tmp_path / ".venv-vllm" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'RuntimeError: no memory for the KV cache' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gen_distill_data, "ROOT", tmp_path)
    if stopped_before_the_batch:  # the batch meets a closed pipe
        send = gen_distill_data.VllmAnswers.__call__

        def after_the_exit(self, batch):
            self.process.wait()
            return send(self, batch)

        monkeypatch.setattr(gen_distill_data.VllmAnswers, "__call__", after_the_exit)
    out = tmp_path / "answers.jsonl"
    assert gen_distill_data.main(["--engine", "vllm", "--base_model", str(directory), "--prompts",
                                  str(data.parent / "prompts.jsonl"), "--out", str(out), "--max_samples", "2"]) == 2
    assert "vLLM stopped (exit 3): RuntimeError: no memory for the KV cache" in capsys.readouterr().err
    assert not out.exists() or not out.read_text()


def test_an_interrupted_vllm_distillation_keeps_its_answers_and_does_not_wait_for_the_batch_under_way(
        distilled, tmp_path, monkeypatch):
    directory, data = distilled
    fake = tmp_path / ".venv-vllm" / "bin" / "python"  # answers one batch, then takes 30 s over the next
    fake.parent.mkdir(parents=True)
    second = tmp_path / "second batch"
    fake.write_text(f"#!/bin/sh\nread batch\necho '[[5, 6, 7]]'\nread batch\ntouch '{second}'\nsleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gen_distill_data, "ROOT", tmp_path)
    out = tmp_path / "answers.jsonl"

    def interrupt_during_the_second_batch():
        deadline = time.monotonic() + 60
        while not second.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        interrupted.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C

    interrupted = []
    # Ctrl-C raises KeyboardInterrupt here also where the suite started with SIGINT ignored (a job that a
    # non-interactive shell put in the background, as `make test ... &` does)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_during_the_second_batch, daemon=True).start()
    try:
        assert gen_distill_data.main(["--engine", "vllm", "--base_model", str(directory), "--prompts",
                                      str(data.parent / "prompts.jsonl"), "--out", str(out), "--max_samples", "2",
                                      "--batch_size", "1"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - interrupted[0] < 10
    assert [json.loads(line)["output_ids"] for line in out.read_text().splitlines()] == [[5, 6, 7]]


def test_a_second_distillation_into_one_file_stops_with_the_reason(distilled, capsys):
    directory, data = distilled
    before = data.read_text()
    with exclusive(data):  # a first run still writing
        assert gen_distill_data.main(["--base_model", str(directory), "--prompts", str(data.parent / "prompts.jsonl"),
                                      "--out", str(data), "--max_samples", "12", "--dtype", "fp32"]) == 2
    assert "another gen_distill_data.py is writing" in capsys.readouterr().err and data.read_text() == before


def test_a_pack_of_distilled_answers_unpacks_to_the_same_records_without_holding_prompt_text(distilled, tmp_path):
    directory, data = distilled
    prompts = data.parent / "prompts.jsonl"
    pack = tmp_path / "answers.npz"
    assert distilled_answers.main(["pack", str(data), "--prompts", str(prompts), "--out", str(pack)]) == 0
    with zipfile.ZipFile(pack) as arrays:
        assert not any(b"fox" in arrays.read(name) for name in arrays.namelist())
    out = tmp_path / "again.jsonl"
    assert distilled_answers.main(["unpack", str(pack), "--out", str(out), "--base_model", str(directory)]) == 0
    assert out.read_text() == data.read_text()


def test_unpacking_against_prompts_that_changed_names_the_prompt(distilled, tmp_path, capsys):
    directory, data = distilled
    pack = tmp_path / "answers.npz"
    assert distilled_answers.main(["pack", str(data), "--prompts", str(data.parent / "prompts.jsonl"),
                                   "--out", str(pack)]) == 0
    edited = tmp_path / "edited.jsonl"
    lines = (data.parent / "prompts.jsonl").read_text().splitlines()
    lines[3] = json.dumps({"prompt": "question number 3 about a dog"})
    edited.write_text("\n".join(lines) + "\n")
    out = tmp_path / "again.jsonl"
    assert distilled_answers.main(["unpack", str(pack), "--out", str(out), "--base_model", str(directory),
                                   "--prompts", str(edited)]) == 2
    assert "prompt 3 of" in capsys.readouterr().err and not out.exists()


def test_an_interrupted_training_leaves_the_heads_in_its_out_as_they_were(distilled, tmp_path, monkeypatch, capsys):
    from transformers import Trainer

    directory, data = distilled
    out = tmp_path / "heads"
    common = ["--base_model", str(directory), "--data", str(data), "--out", str(out), "--cache_hidden",
              "--batch_size", "32", "--dtype", "fp32", "--epochs", "1"]
    assert train_medusa.main(common + ["--num_heads", "2"]) == 0
    files = {name: (out / name).read_bytes() for name in ("config.json", "medusa_lm_head.safetensors")}

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train", interrupted)
    assert train_medusa.main(common + ["--num_heads", "3", "--head_input", "hidden_and_path"]) == 130
    assert "--resume" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in files} == files
    config = json.loads(files["config.json"])
    assert load_heads(out, config["hidden_size"], config["vocab_size"]).num_heads == 2
    assert json.loads((out / "medusa_run_config.json").read_text())["medusa_num_heads"] == 3  # for --resume, export


@pytest.mark.parametrize("head_input,options", [
    ("hidden", ["--cache_hidden"]), ("hidden_and_next_token", []),
    ("hidden_and_path", ["--cache_hidden", "--soft_targets"]), ("hidden_and_path", ["--soft_targets"]),
    ("hidden_and_path", ["--cache_hidden", "--soft_targets", "--draft_vocab_size", "30"]),
])
def test_training_saves_heads_that_medusa_generate_loads(distilled, tmp_path, capsys, head_input, options):
    directory, data = distilled
    out = tmp_path / "heads"
    assert train_medusa.main(["--base_model", str(directory), "--data", str(data), "--out", str(out),
                              "--num_heads", "3", "--epochs", "2", "--batch_size", "32", "--dtype", "fp32",
                              "--lr", "3e-3", "--head_input", head_input] + options) == 0
    report = json.loads((out / "training_report.json").read_text())
    assert [row["head"] for row in report["held_out_accuracy"]] == [0, 1, 2]
    assert json.loads((out / "config.json").read_text()).get("medusa_head_input", "hidden") == head_input
    assert medusa_generate.main(["--base_model", str(directory), "--medusa_dir", str(out), "--prompt", "hi",
                                 "--max_new_tokens", "8", "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["new_tokens"] == 8

    config = json.loads((out / "config.json").read_text())
    trained_over = load_heads(out, config["hidden_size"], config["vocab_size"]).draft_vocab
    assert draft_vocab.main(["--heads", str(out), "--data", str(data), "--size", "20"]) == (0 if trained_over is None else 2)
    heads = load_heads(out, config["hidden_size"], config["vocab_size"])
    if trained_over is None:
        assert heads.draft_vocab.tolist() == most_frequent_tokens(read_samples(data), 20)
    else:  # heads trained over a draft vocabulary keep the one they learned
        assert heads.draft_vocab.tolist() == trained_over.tolist() and len(trained_over) > 20

    tree_file = tmp_path / "tree.json"
    assert medusa_tree_builder.main(["--base_model", str(directory), "--heads", str(out), "--data", str(data),
                                     "--out", str(tree_file), "--nodes", "4", "--budgets", "2,4,8",
                                     "--dtype", "fp32", "--save_in_heads"]) == 0
    built = json.loads(tree_file.read_text())
    assert built["budget"] in (2, 4, 8) and load_tree(str(tree_file), num_heads=3) == validate_tree(built["tree"])
    held_out = built["held_out_tokens_per_step"]
    assert set(held_out) == ({"tree", "dynamic"} if heads.propose_after_verification else {"tree"})
    assert all(1 <= v <= 4 for v in held_out.values())
    saved = f"dynamic:{built['budget']}" if held_out.get("dynamic", 0) > held_out["tree"] else built["tree"]
    assert json.loads((out / "config.json").read_text())["medusa_choices"] == saved


@pytest.mark.parametrize("features", ["cached", "online"])
def test_feature_drafter_training_saves_a_drafter_the_tree_builder_and_medusa_generate_read(distilled, tmp_path, capsys,
                                                                                            monkeypatch, features):
    directory, data = distilled
    cache = tmp_path / "features"
    options = ["--features_cache", str(cache)] if features == "cached" else ["--online_features", "--unroll", "2"]
    common = ["--base_model", str(directory), "--data", str(data), "--levels", "3", "--epochs", "2",
              "--tokens_per_batch", "256", "--dtype", "fp32", "--draft_vocab_size", "20", *options]
    out = tmp_path / "drafter"
    assert train_feature_drafter.main(common + ["--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    drafter = load_heads(out, config["hidden_size"], config["vocab_size"])
    assert isinstance(drafter, FeatureDrafter) and drafter.num_heads == 3 and len(drafter.draft_vocab) == 20
    report = json.loads((out / "training_report.json").read_text())
    assert report["held_out_samples"] == 1 and report["steps"] > 2 and len(report["held_out_accuracy"]) == 3
    if features == "cached":  # a second run reads the features it kept and trains the same drafter
        def recomputed(*args, **kwargs):
            raise AssertionError("features recomputed despite the cache")

        monkeypatch.setattr(features_cache, "base_features", recomputed)
        assert train_feature_drafter.main(common + ["--out", str(tmp_path / "again")]) == 0
        again = load_heads(tmp_path / "again", config["hidden_size"], config["vocab_size"])
        assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))
        # data added later: only the new samples' features are computed
        added = tmp_path / "added.jsonl"
        records = [json.loads(line) for line in data.read_text().splitlines()[:2]]
        added.write_text("".join(json.dumps({**r, "output_ids": r["output_ids"] + [7]}) + "\n" for r in records))
        computed = []

        def counted(model, samples, *args, **kwargs):
            computed.extend(samples)
            return base_features(model, samples, *args, **kwargs)

        monkeypatch.setattr(features_cache, "base_features", counted)
        with_added = [*common[:common.index("--data") + 2], str(added), *common[common.index("--data") + 2:]]
        assert train_feature_drafter.main(with_added + ["--out", str(tmp_path / "more")]) == 0
        assert [s["output_ids"] for s in computed] == [r["output_ids"] + [7] for r in records]
        monkeypatch.undo()

    tree_file = tmp_path / "tree.json"
    assert medusa_tree_builder.main(["--base_model", str(directory), "--heads", str(out), "--data", str(data),
                                     "--out", str(tree_file), "--nodes", "6", "--budgets", "2,4", "--dtype", "fp32",
                                     "--save_in_heads"]) == 0
    built = json.loads(tree_file.read_text())
    assert load_tree(built["tree"]) == load_tree("dynamic:6") and [c["budget"] for c in built["candidates"]] == [2, 4]
    saved = json.loads((out / "config.json").read_text())
    assert saved["medusa_choices"] == built["tree"] and saved["medusa_head_accuracy"] == built["head_rank_accuracy"]
    assert len(built["head_rank_accuracy"]) == 3
    assert medusa_generate.main(["--base_model", str(directory), "--medusa_dir", str(out), "--prompt", "hi",
                                 "--max_new_tokens", "8", "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["new_tokens"] == 8


def test_a_drafter_trained_on_a_bf16_base_is_scored_as_it_drafts_and_saved_in_fp32(distilled, tmp_path):
    directory, data = distilled
    out = tmp_path / "drafter"
    assert train_feature_drafter.main(["--base_model", str(directory), "--data", str(data), "--out", str(out),
                                       "--levels", "2", "--epochs", "1", "--tokens_per_batch", "256",
                                       "--dtype", "bf16", "--draft_vocab_size", "20"]) == 0
    report = json.loads((out / "training_report.json").read_text())
    assert len(report["held_out_accuracy"]) == 2
    config = json.loads((out / "config.json").read_text())
    drafter = load_heads(out, config["hidden_size"], config["vocab_size"])
    assert all(p.dtype == torch.float32 for p in drafter.parameters())


def mapped_from(path: Path, tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s data lies in a memory map of the file `path` (Linux)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= tensor.data_ptr() < high:
                return True
    return False


def mapped_from_cache(cache: Path, tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s data lies in a memory map of one of the features cache's shard files."""
    return any(mapped_from(shard, tensor) for shard in cache.glob("*.pt"))


def saved_heads(directory: Path):
    """The heads or drafter a training run saved in `directory`, loaded by their own config."""
    config = json.loads((directory / "config.json").read_text())
    return load_heads(directory, config["hidden_size"], config["vocab_size"])


def test_a_drafter_trained_from_another_starts_from_its_weights_and_proposes_from_the_runs_vocabulary(distilled,
                                                                                                      tmp_path, capsys):
    directory, data = distilled
    common = ["--base_model", str(directory), "--data", str(data), "--levels", "2", "--tokens_per_batch", "256",
              "--dtype", "fp32"]
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "first"), "--epochs", "1",
                                                "--draft_vocab_size", "20"]) == 0
    first = saved_heads(tmp_path / "first")
    # a learning rate this small leaves the weights where they started
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "further"), "--epochs", "1", "--lr", "1e-12",
                                                "--init", str(tmp_path / "first"), "--draft_vocab_size", "25"]) == 0
    further = saved_heads(tmp_path / "further")
    assert len(further.draft_vocab) == 25
    layer = [k for k in first.state_dict() if k != "draft_vocab"]
    assert all(torch.allclose(first.state_dict()[k], further.state_dict()[k], atol=1e-6) for k in layer)
    heads = tmp_path / "heads"
    assert train_medusa.main(["--base_model", str(directory), "--data", str(data), "--out", str(heads),
                              "--num_heads", "2", "--epochs", "1", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "none"), "--init", str(heads)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--init {heads} is not a feature drafter for this base model")


def test_a_fused_drafter_trains_from_a_plain_one_and_shares_its_feature_cache(distilled, tmp_path, capsys, monkeypatch):
    directory, data = distilled
    cache = tmp_path / "features"
    common = ["--base_model", str(directory), "--data", str(data), "--levels", "2", "--tokens_per_batch", "256",
              "--dtype", "fp32", "--epochs", "1", "--features_cache", str(cache)]
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "plain")]) == 0
    # from the plain drafter's weights, with a learning rate that leaves them as they were: the fusion starts at zero
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "fused"), "--aux_layers", "1,3", "--lr", "1e-12",
                                                "--init", str(tmp_path / "plain")]) == 0
    plain, fused = saved_heads(tmp_path / "plain"), saved_heads(tmp_path / "fused")
    assert fused.aux_layers == (1, 3) and fused.fuse.weight.abs().max() < 1e-6
    assert all(torch.allclose(v, fused.state_dict()[k], atol=1e-6) for k, v in plain.state_dict().items())
    # a plain drafter reads the fused run's cache (it holds the final features too) without the base model, mapped
    # from its files rather than copied into memory
    monkeypatch.setattr(features_cache, "base_features", lambda *args, **kwargs: pytest.fail("recomputed"))
    trained_on = []
    train = train_feature_drafter.train_drafter
    monkeypatch.setattr(train_feature_drafter, "train_drafter",
                        lambda loss, features, *rest: trained_on.extend(features) or train(loss, features, *rest))
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "again")]) == 0
    monkeypatch.undo()
    assert trained_on and all(mapped_from_cache(cache, sample.features) for sample in trained_on)
    capsys.readouterr()
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "deep"), "--aux_layers", "4"]) == 2
    assert capsys.readouterr().err.strip().endswith("--aux_layers: the base model has layers 1..3 to fuse (an index "
                                                    ">= 1 names the input of that layer), not [4]")
    assert medusa_generate.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "fused"),
                                 "--prompt", "hi", "--max_new_tokens", "8", "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["new_tokens"] == 8


def save_to_a_full_disk(obj, f, *args, **kwargs):
    """torch.save as it fails on a full disk: part of the file written, then a many-line RuntimeError."""
    Path(f).write_bytes(b"part")
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2115 vs 2114\nmore")


def cache_of_the_first_half(distilled, tmp_path: Path) -> tuple[Path, list[str], Path]:
    """A features cache written by a drafter run over half the distilled samples: the cache, the options that
    read it, and the whole data (whose other half a second run adds)."""
    directory, data = distilled
    cache = tmp_path / "features"
    first_half = tmp_path / "first.jsonl"
    first_half.write_text("".join(data.read_text().splitlines(keepends=True)[:5]))
    common = ["--levels", "2", "--tokens_per_batch", "256", "--dtype", "fp32", "--epochs", "1",
              "--base_model", str(directory), "--features_cache", str(cache)]
    assert train_feature_drafter.main(common + ["--data", str(first_half), "--out", str(tmp_path / "first")]) == 0
    return cache, common, data


def shard_contents(cache: Path) -> dict[str, set[str]]:
    """Each shard file's name and the sample keys it holds."""
    return {shard.name: set(torch.load(shard, weights_only=False, mmap=True)["features"]) for shard in cache.glob("*.pt")}


def test_a_growing_features_cache_adds_shards_of_the_new_samples_and_never_rewrites_one(distilled, tmp_path,
                                                                                        monkeypatch):
    """Rewriting the whole cache at every write costs minutes and twice its size in disk for a 25 GB cache; new
    samples go into new shard files and the training reads every feature mapped from them."""
    cache, common, data = cache_of_the_first_half(distilled, tmp_path)
    (first,) = cache.glob("*.pt")
    before, first_keys = first.stat(), shard_contents(cache)[first.name]
    monkeypatch.setattr(features_cache, "SHARD_SAMPLES", 2)  # the five new samples in three shards
    seen = {}
    train = train_feature_drafter.train_drafter

    def spying(loss, features, *rest):
        seen["mapped"] = all(mapped_from_cache(cache, sample.features) for sample in features)
        seen["replaced"] = [line for line in Path("/proc/self/maps").read_text().splitlines() if "(deleted)" in line
                            and str(cache) in line]
        return train(loss, features, *rest)

    monkeypatch.setattr(train_feature_drafter, "train_drafter", spying)
    assert train_feature_drafter.main(common + ["--data", str(data), "--out", str(tmp_path / "all")]) == 0
    after = first.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    shards = shard_contents(cache)
    new = [keys for name, keys in shards.items() if name != first.name]
    assert sorted(len(keys) for keys in new) == [1, 2, 2] and not set.union(*new) & first_keys
    assert seen == {"mapped": True, "replaced": []}
    assert sorted(p.name for p in cache.iterdir()) == sorted(shards)  # no staging file left


def test_a_features_cache_that_cannot_be_written_fails_in_one_line_and_keeps_its_shards(distilled, tmp_path, capsys,
                                                                                      monkeypatch):
    cache, common, data = cache_of_the_first_half(distilled, tmp_path)
    kept = {shard.name: shard.read_bytes() for shard in cache.iterdir()}

    monkeypatch.setattr(torch, "save", save_to_a_full_disk)
    capsys.readouterr()
    assert train_feature_drafter.main(common + ["--data", str(data), "--out", str(tmp_path / "all")]) == 2
    error = capsys.readouterr().err.strip().split("\n")[-1]
    assert error.startswith(f"error: --features_cache {cache}: could not write a shard ([enforce fail at "
                            "inline_container.cc:672] . unexpected pos 2115 vs 2114); ")  # the first line only
    assert "GB free on its disk" in error and error.endswith("the shards written before are kept, and a rerun "
                                                              "computes only the rest")
    assert {shard.name: shard.read_bytes() for shard in cache.iterdir()} == kept


def test_a_features_cache_reads_only_shards_of_its_settings_and_keeps_the_others(distilled, tmp_path, capsys,
                                                                               monkeypatch):
    cache, common, data = cache_of_the_first_half(distilled, tmp_path)
    first_half = tmp_path / "first.jsonl"
    computed = []

    def counted(model, samples, *args, **kwargs):
        computed.extend(samples)
        return base_features(model, samples, *args, **kwargs)

    monkeypatch.setattr(features_cache, "base_features", counted)
    capsys.readouterr()
    in_bf16 = common + ["--data", str(first_half), "--dtype", "bf16"]  # the same samples, features of another dtype
    assert train_feature_drafter.main(in_bf16 + ["--out", str(tmp_path / "bf16")]) == 0
    assert len(computed) == 5 and len(list(cache.glob("*.pt"))) == 2
    assert (f"features cache {cache}: 1 shard(s) of another base model, dtype, --max_length or fused layers left as "
            "they are") in capsys.readouterr().err
    computed.clear()
    for options in (in_bf16, common + ["--data", str(first_half)]):  # each reads its own shard again
        assert train_feature_drafter.main(options + ["--out", str(tmp_path / "again")]) == 0
    assert computed == []


def test_a_features_cache_given_as_a_file_says_how_to_keep_it(distilled, tmp_path, capsys, monkeypatch):
    """A cache file of an earlier version holds what one shard holds: moved into a directory, it is read."""
    cache, common, data = cache_of_the_first_half(distilled, tmp_path)
    (shard,) = cache.glob("*.pt")
    old = tmp_path / "features.pt"
    shard.rename(old)
    cache.rmdir()
    capsys.readouterr()
    options = [*common[: common.index("--features_cache")], "--features_cache", str(old), "--data", str(data)]
    assert train_feature_drafter.main(options + ["--out", str(tmp_path / "again")]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"error: --features_cache {old} is a file: give a directory, which keeps one file per 2000 "
                     f"samples (a cache file of an earlier version is one of them: mkdir DIR && mv {old} DIR/)")
    cache.mkdir()
    old.rename(cache / old.name)
    monkeypatch.setattr(features_cache, "base_features", lambda *args, **kwargs: pytest.fail("recomputed"))
    first_half = tmp_path / "first.jsonl"
    assert train_feature_drafter.main(common + ["--data", str(first_half), "--out", str(tmp_path / "again")]) == 0


def test_a_drafter_grows_by_a_layer_from_the_one_it_starts_from_and_never_shrinks(distilled, tmp_path, capsys,
                                                                                  monkeypatch):
    directory, data = distilled
    common = ["--base_model", str(directory), "--data", str(data), "--levels", "2", "--tokens_per_batch", "256",
              "--dtype", "fp32", "--epochs", "1"]
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "one")]) == 0
    # a learning rate that leaves the weights as they were: the added layer stays an identity
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "two"), "--layers", "2", "--lr", "1e-12",
                                                "--init", str(tmp_path / "one")]) == 0
    one, two = saved_heads(tmp_path / "one"), saved_heads(tmp_path / "two")
    assert len(two.layers) == 2 and two.layers[1].mlp.down_proj.weight.abs().max() < 1e-6
    assert all(torch.allclose(v, two.state_dict()[k], atol=1e-6) for k, v in one.state_dict().items())
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "again"), "--init", str(tmp_path / "two")]) == 0
    assert len(saved_heads(tmp_path / "again").layers) == 2  # --init's layers by default
    capsys.readouterr()
    # refused before the base features, which take minutes on real data
    monkeypatch.setattr(train_feature_drafter, "base_features", lambda *args, **kwargs: pytest.fail("features first"))
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "less"), "--layers", "1",
                                                "--init", str(tmp_path / "two")]) == 2
    monkeypatch.undo()
    assert capsys.readouterr().err.strip().endswith("--layers 1: --init's drafter has 2 decoder layers (a drafter can "
                                                    "add layers to the one it starts from, not drop them)")
    assert medusa_generate.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "two"),
                                 "--prompt", "hi", "--max_new_tokens", "8", "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["new_tokens"] == 8


def test_a_draft_vocabulary_cut_keeps_its_most_frequent_tokens_for_heads_and_for_a_feature_drafter(distilled,
                                                                                                    tmp_path, capsys):
    directory, data = distilled
    common = ["--base_model", str(directory), "--data", str(data), "--epochs", "1", "--dtype", "fp32",
              "--draft_vocab_size", "20"]
    assert train_medusa.main(common + ["--out", str(tmp_path / "heads"), "--num_heads", "2",
                                       "--head_input", "hidden_and_path"]) == 0
    assert train_feature_drafter.main(common + ["--out", str(tmp_path / "drafter"), "--levels", "2",
                                                "--tokens_per_batch", "256"]) == 0
    for name, kind in [("heads", MedusaHeads), ("drafter", FeatureDrafter)]:
        before = saved_heads(tmp_path / name)
        assert draft_vocab.main(["--heads", str(tmp_path / name), "--keep", "20"]) == 2  # not a cut
        with pytest.raises(SystemExit):  # a cut counts nothing: data given with it would be ignored
            draft_vocab.main(["--heads", str(tmp_path / name), "--keep", "8", "--data", str(data)])
        assert draft_vocab.main(["--heads", str(tmp_path / name), "--keep", "8"]) == 0
        after = saved_heads(tmp_path / name)
        assert isinstance(after, kind) and after.draft_vocab.tolist() == before.draft_vocab.tolist()[:8]
        assert all(torch.equal(before.state_dict()[k], v) for k, v in after.state_dict().items() if k != "draft_vocab")
    assert "--keep" in capsys.readouterr().err


def test_cached_rows_carry_the_true_next_tokens_and_the_base_distribution_over_each_target(distilled, tiny_pangu):
    directory, data = distilled
    model = tiny_pangu[1]
    samples = read_samples(data)[:3]
    rows = CachedPositions(*cache_hidden_states(model, samples, num_heads=3, max_length=2048), soft_targets=True)
    ids = [s["prompt_ids"] + s["output_ids"] for s in samples]
    positions = [(k, t) for k, s in enumerate(samples) for t in range(len(s["prompt_ids"]) - 1, len(ids[k]) - 1)]
    assert len(rows) == len(positions)
    checked = 0
    for row, (k, t) in enumerate(positions):
        item = rows[row]
        assert item["following_ids"].tolist() == (ids[k] + [0, 0, 0])[t + 1 : t + 4]  # teacher forcing
        for i, label in enumerate(item["labels"].tolist()):
            if label != IGNORE:  # greedy data: the base model's own choice for token t+2+i is the label
                assert model.lm_head(item["teacher_hidden"][i]).argmax().item() == label == ids[k][t + 2 + i]
                checked += 1
    assert checked > 3 * len(samples)


def test_soft_targets_equal_hard_ones_for_a_certain_teacher():
    logits = torch.randn(5, 11)
    labels = torch.tensor([1, 4, 0, 10, 3])
    certain = torch.full((5, 11), -1e4).scatter(1, labels.unsqueeze(1), 1e4)
    assert torch.allclose(soft_cross_entropy(logits, certain), torch.nn.functional.cross_entropy(logits, labels))


def test_draft_vocabulary_keeps_the_most_frequent_answer_tokens():
    samples = [{"prompt_ids": [1, 1, 1], "output_ids": [5, 7, 7, 9]}, {"prompt_ids": [1], "output_ids": [9, 7, 4, 5]}]
    assert most_frequent_tokens(samples, 3) == [7, 5, 9]  # 5 and 9 tie: lower id first
    assert most_frequent_tokens(samples, 10) == [7, 5, 9, 4]


def test_rows_carry_teacher_hidden_states_only_for_soft_targets():
    rows = (torch.randn(6, 4), torch.zeros(6, 2, dtype=torch.long), torch.zeros(6, 2, dtype=torch.long))
    assert "teacher_hidden" not in CachedPositions(*rows)[0]
    assert torch.equal(CachedPositions(*rows, soft_targets=True)[2]["teacher_hidden"], rows[0][3:5])


@pytest.mark.parametrize("soft", [False, True])
def test_heads_with_a_draft_vocabulary_train_over_its_rows_and_skip_targets_outside_it(tiny_pangu, soft):
    model = tiny_pangu[1]
    draft = [5, 9, 2, 30, 17]
    heads = random_heads(model, num_heads=2, draft_vocab=draft)
    module = MedusaTrainingModule(heads, model.lm_head, model.get_input_embeddings(), None, [1.0, 0.5], soft)
    hidden = torch.randn(4, model.config.hidden_size)
    labels = torch.tensor([[9, 17], [11, IGNORE], [5, 2], [IGNORE, 40]])  # 11 and 40 are not in the draft
    teacher_hidden = torch.randn(4, 2, model.config.hidden_size)
    loss = module(labels, hidden_states=hidden, following_ids=torch.zeros(4, 2, dtype=torch.long),
                  teacher_hidden=teacher_hidden)["loss"]
    rows = model.lm_head.weight[draft]
    with torch.no_grad():
        logits = heads.states(hidden) @ rows.T  # [heads, 4, 5]: scores over the draft rows only
        kept = {0: ([0, 2], [1, 0]), 1: ([0, 2], [4, 2])}  # rows and their draft indices per head
        expected = 0.0
        for i, weight in enumerate([1.0, 0.5]):
            positions, indices = kept[i]
            if soft:
                teacher = teacher_hidden[positions, i] @ rows.T
                expected += weight * soft_cross_entropy(logits[i, positions], teacher)
            else:
                expected += weight * torch.nn.functional.cross_entropy(logits[i, positions], torch.tensor(indices))
    assert torch.allclose(loss, expected, atol=1e-5)
    assert [counted for _, _, counted in module.last_accuracy] == [3, 3]  # accuracy counts every target


def cached_copy(distilled, model, directory):
    """(data, samples, hidden rows) of a copy of the distilled data whose hidden states were just cached."""
    data = directory / "data.jsonl"
    data.write_bytes(distilled[1].read_bytes())
    samples = read_samples(data)
    return data, samples, medusa_training.cached_answer_hidden_states(model, data, samples, 2048)


def test_hidden_states_are_cached_beside_the_data_and_remade_when_it_changes(distilled, tiny_pangu, tmp_path, monkeypatch):
    model = tiny_pangu[1]
    data, samples, first = cached_copy(distilled, model, tmp_path)
    assert (tmp_path / "data.jsonl.hidden.pt").is_file()

    def base_forward(*args, **kwargs):
        raise AssertionError("the base model ran although its hidden states were cached")

    with monkeypatch.context() as patch:
        patch.setattr(medusa_training, "answer_hidden_states", base_forward)
        again = medusa_training.cached_answer_hidden_states(model, data, samples, 2048)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    data.write_text("".join(reversed(data.read_text().splitlines(keepends=True))))  # as many samples, others first
    remade = medusa_training.cached_answer_hidden_states(model, data, read_samples(data), 2048)
    assert all(torch.equal(a, b) for a, b in zip(reversed(first), remade))
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:4]))
    fewer = read_samples(data)
    assert len(medusa_training.cached_answer_hidden_states(model, data, fewer, 2048)) == len(fewer) == 4


def test_a_corrupt_hidden_state_cache_is_made_again_with_a_notice(distilled, tiny_pangu, tmp_path, capsys):
    model = tiny_pangu[1]
    data, samples, first = cached_copy(distilled, model, tmp_path)
    cache = tmp_path / "data.jsonl.hidden.pt"
    cache.write_bytes(cache.read_bytes()[:100])
    again = medusa_training.cached_answer_hidden_states(model, data, samples, 2048)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert "is unreadable" in capsys.readouterr().err
    assert medusa_training.cached_answer_hidden_states(model, data, samples, 2048)  # the remade cache reads


def test_a_hidden_state_cache_that_cannot_be_written_is_a_notice_and_training_goes_on(distilled, tiny_pangu,
                                                                                      tmp_path, capsys, monkeypatch):
    model = tiny_pangu[1]
    data, samples, first = cached_copy(distilled, model, tmp_path)
    (tmp_path / "data.jsonl.hidden.pt").unlink()

    monkeypatch.setattr(torch, "save", save_to_a_full_disk)
    again = medusa_training.cached_answer_hidden_states(model, data, samples, 2048)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    notice = capsys.readouterr().err.strip().split("\n")
    assert notice == [f"hidden-state cache {tmp_path / 'data.jsonl.hidden.pt'} could not be written ([enforce fail at "
                      "inline_container.cc:672] . unexpected pos 2115 vs 2114): training goes on without it"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # neither the cache nor its staging file


def test_a_hidden_state_cache_write_that_fails_without_a_message_is_still_a_one_line_notice(distilled, tiny_pangu,
                                                                                             tmp_path, capsys,
                                                                                             monkeypatch):
    model = tiny_pangu[1]
    data, samples, first = cached_copy(distilled, model, tmp_path)
    (tmp_path / "data.jsonl.hidden.pt").unlink()

    def save_failing_silently(obj, f, *args, **kwargs):
        raise RuntimeError()

    monkeypatch.setattr(torch, "save", save_failing_silently)
    assert len(medusa_training.cached_answer_hidden_states(model, data, samples, 2048)) == len(first)
    assert capsys.readouterr().err == (f"hidden-state cache {tmp_path / 'data.jsonl.hidden.pt'} could not be written "
                                       "(): training goes on without it\n")


def test_rank_accuracy_scores_proposals_through_the_draft_vocabulary(tiny_pangu):
    model = tiny_pangu[1]
    vocab = model.config.vocab_size
    hidden = torch.randn(40, model.config.hidden_size)
    with torch.no_grad():
        targets = random_heads(model, num_heads=2)(hidden, model.lm_head).argmax(-1).T  # each head's own top-1
    following_ids = torch.zeros(40, 2, dtype=torch.long)
    reordered = torch.randperm(vocab).tolist()
    without_targets = sorted(set(range(vocab)) - set(targets.flatten().tolist()))
    for draft, top1 in ((None, 1.0), (reordered, 1.0), (without_targets, 0.0)):
        heads = random_heads(model, num_heads=2, draft_vocab=draft)
        accuracy = medusa_tree_builder.rank_accuracy(heads, model, hidden, targets, following_ids, top_k=3)
        assert [row[0] for row in accuracy] == [top1, top1]


# The builder measures the heads' own nodes: a dynamic tree without the context lookup, which needs the text.
@pytest.mark.parametrize("tree", ["tree_16", "dynamic:16:lookup=0"])
def test_held_out_acceptance_is_what_decoding_accepts_where_its_steps_start(tiny_pangu, tree):
    model = tiny_pangu[1]
    prompts = random_prompts(model.config.vocab_size, count=2)
    decoder = MedusaDecoder(model, fit_heads(model, prompts, 48, num_heads=3, steps=100, head_input="hidden_and_path"))
    for prompt in prompts:
        answer = plain_greedy(model, prompt, 48)
        hidden, targets, following_ids = cache_hidden_states(model, [{"prompt_ids": prompt, "output_ids": answer}],
                                                             3, 2048)
        drafted = medusa_tree_builder.drafted_acceptance(decoder, hidden, targets, following_ids, load_tree(tree))
        steps = list(decoder.decode(DecodeRequest(prompt, 48), load_tree(tree)))[1:]  # after the prefill's token
        starts = torch.tensor([0] + [len(s) for s in steps[:-2]]).cumsum(0)  # the row each step drafts from
        assert drafted[starts].tolist() == [len(s) - 1 for s in steps[:-1]]  # the last one is cut at 48 tokens
        assert max(len(s) for s in steps) > 2  # several candidates accepted in some steps


def test_training_resumes_from_its_last_checkpoint(distilled, tmp_path, caplog):
    directory, data = distilled
    out = tmp_path / "heads"
    common = ["--base_model", str(directory), "--data", str(data), "--out", str(out), "--num_heads", "2",
              "--cache_hidden", "--batch_size", "32", "--dtype", "fp32"]
    assert train_medusa.main(common + ["--epochs", "1"]) == 0
    first = json.loads((out / "training_report.json").read_text())["steps"]
    assert (out / f"checkpoint-{first}").is_dir()
    caplog.set_level(logging.INFO, logger="transformers.trainer")
    assert train_medusa.main(common + ["--epochs", "2", "--resume"]) == 0
    assert f"Loading model from {out / f'checkpoint-{first}'}" in caplog.text
    state = json.loads((out / f"checkpoint-{2 * first}" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 * first


def test_a_checkpoint_exports_to_the_heads_the_run_had_at_that_step(distilled, tmp_path, capsys):
    directory, data = distilled
    out = tmp_path / "heads"
    assert train_medusa.main(["--base_model", str(directory), "--data", str(data), "--out", str(out),
                              "--num_heads", "2", "--head_input", "hidden_and_path", "--cache_hidden",
                              "--batch_size", "32", "--dtype", "fp32", "--epochs", "1"]) == 0
    steps = json.loads((out / "training_report.json").read_text())["steps"]
    assert export_checkpoint.main(["--checkpoint", str(out / f"checkpoint-{steps}"), "--out", str(tmp_path / "x")]) == 0
    assert f"training step {steps}" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    final, exported = (load_heads(d, config["hidden_size"], config["vocab_size"]) for d in (out, tmp_path / "x"))
    assert exported.config == final.config and exported.config.medusa_head_input == "hidden_and_path"
    for key, value in final.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value)
    assert export_checkpoint.main(["--checkpoint", str(tmp_path / "x"), "--out", str(tmp_path / "y")]) == 2


@pytest.mark.parametrize("name,local_rank,expected", [
    ("npu", "3", "npu:3"), ("cuda", "1", "cuda:1"), ("npu:2", "3", "npu:2"), ("cpu", "3", "cpu"), ("npu", None, "npu"),
])
def test_each_torchrun_process_trains_on_its_own_device(name, local_rank, expected):
    assert train_medusa.process_device(name, local_rank) == expected


def test_tree_builder_records_its_tree_in_a_combined_directory_where_it_is_read(distilled, tmp_path):
    from medusa_model import MedusaModel

    directory, data = distilled
    model = load_causal_lm(directory, torch.device("cpu"), torch.float32)
    combined = tmp_path / "combined"
    MedusaModel(model, random_heads(model, num_heads=2)).save_pretrained(combined, layout="combined")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (combined / name).write_bytes((directory / name).read_bytes())
    assert medusa_tree_builder.main(["--heads", str(combined), "--data", str(data), "--out", str(tmp_path / "t.json"),
                                     "--nodes", "3", "--dtype", "fp32", "--save_in_heads"]) == 0
    built = json.loads((tmp_path / "t.json").read_text())
    loaded = MedusaModel.from_pretrained(str(combined), device="cpu", dtype="fp32", tree="heads")
    assert loaded.tree == built["tree"]
    assert loaded.medusa_head.config.medusa_head_accuracy == built["head_rank_accuracy"]


def test_tree_builder_refuses_more_ranks_than_the_heads_propose_from(distilled, tmp_path, capsys):
    directory, data = distilled
    model = load_causal_lm(directory, torch.device("cpu"), torch.float32)
    heads = random_heads(model, num_heads=2, head_input="hidden_and_path", draft_vocab=list(range(40)))
    save_heads(heads, tmp_path / "heads")
    assert medusa_tree_builder.main(["--base_model", str(directory), "--heads", str(tmp_path / "heads"), "--data",
                                     str(data), "--out", str(tmp_path / "t.json"), "--top_k", "41",
                                     "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "error: --top_k 41 is more ranks than the heads have (40 tokens" in err and "Traceback" not in err


def test_repeated_samples_are_trained_on_once():
    a, b = {"prompt_ids": [1, 2], "output_ids": [3, 4]}, {"prompt_ids": [1, 2], "output_ids": [3, 5]}
    c = {"prompt_ids": [9], "output_ids": [3, 4]}
    assert distinct([a, b, dict(a), c, dict(b)]) == [a, b, c]
