"""Medusa inside one checkpoint, conversion between layouts, and the transformers-style generate()."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from inference import convert_medusa, generate, medusa_generate
from medusa_choices import load_tree
from medusa_helpers import hf_greedy, random_heads, random_prompts, upper_half_vocab
import medusa_model
from medusa_model import MedusaModel, load_heads


@pytest.fixture(scope="module", params=["own_lm_head", "own_lm_head+next_token", "shared_lm_head+next_token+draft"])
def medusa(tiny_pangu, request):
    directory, model = tiny_pangu
    layout, *options = request.param.split("+")
    head_input = "hidden_and_next_token" if "next_token" in options else "hidden"
    draft_vocab = upper_half_vocab(model) if "draft" in options else None
    heads = random_heads(model, num_heads=3, layout=layout, head_input=head_input, draft_vocab=draft_vocab)
    return MedusaModel(model, heads, AutoTokenizer.from_pretrained(directory), tree=load_tree("tree_16"))


def test_one_checkpoint_round_trip_generates_like_plain_greedy(medusa, tmp_path):
    medusa.save_pretrained(tmp_path, layout="one_checkpoint")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_choices"] == load_tree("tree_16")
    assert not (tmp_path / "medusa_lm_head.safetensors").exists()
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as weights:
        assert any(k.startswith("medusa_head.0.") for k in weights.keys())
    loaded = MedusaModel.from_pretrained(str(tmp_path), device="cpu", dtype="fp32")
    assert loaded.tree == load_tree("tree_16")
    for key, value in medusa.medusa_head.state_dict().items():
        assert torch.equal(loaded.medusa_head.state_dict()[key], value)
    prompt = random_prompts(medusa.config.vocab_size, count=1, seed=5)[0]
    out = [t for s in loaded.medusa_generate(prompt, max_new_tokens=48) for t in s]
    assert out == hf_greedy(medusa.base_model, prompt, 48)


def test_one_checkpoint_directory_runs_in_the_cli(medusa, tmp_path, capsys):
    medusa.save_pretrained(tmp_path, layout="one_checkpoint")
    argv = ["--base_model", str(tmp_path), "--prompt", "hello", "--max_new_tokens", "20", "--dtype", "fp32", "--json"]
    assert medusa_generate.main(argv) == 0
    spec = json.loads(capsys.readouterr().out)
    assert generate.main(argv) == 0
    assert spec["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


def test_conversion_between_layouts_keeps_the_heads_and_compiles_nothing(medusa, tiny_pangu, tmp_path, monkeypatch):
    directory, model = tiny_pangu
    monkeypatch.setenv("OPENPANGU_MEDUSA_COMPILE", "auto")

    def timed(*args, **kwargs):
        raise AssertionError("a conversion timed captured steps")

    monkeypatch.setattr(medusa_model, "graph_profile", timed)
    medusa.save_pretrained(tmp_path / "heads", layout="heads")
    assert convert_medusa.main(["--base_model", str(directory), "--medusa_dir", str(tmp_path / "heads"),
                                "--out", str(tmp_path / "one"), "--layout", "one_checkpoint", "--dtype", "fp32",
                                "--medusa_choices", "chain_3"]) == 0
    assert convert_medusa.main(["--base_model", str(tmp_path / "one"), "--out", str(tmp_path / "back"),
                                "--layout", "heads", "--dtype", "fp32"]) == 0
    back = load_heads(tmp_path / "back", model.config.hidden_size, model.config.vocab_size)
    for key, value in medusa.medusa_head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)
    loaded = MedusaModel.from_pretrained(str(tmp_path / "one"), device="cpu", dtype="fp32", compile="off")
    assert loaded.tree == load_tree("chain_3")


def test_generate_api_matches_hf_generate(medusa):
    model = medusa.base_model
    for prompt in random_prompts(model.config.vocab_size, count=4, seed=9):
        ids = torch.tensor([prompt])
        ours = medusa.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
        hf = model.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
        assert torch.equal(ours, hf)


def test_generate_drops_left_padding_and_feeds_a_streamer(medusa):
    prompt = random_prompts(medusa.config.vocab_size, count=1, seed=2)[0]
    padded = torch.tensor([[0, 0] + prompt])
    mask = torch.tensor([[0, 0] + [1] * len(prompt)])

    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = medusa.generate(padded, attention_mask=mask, max_new_tokens=12, streamer=streamer)
    assert out[0].tolist() == prompt + hf_greedy(medusa.base_model, prompt, 12)
    assert streamer.ended and sum(streamer.chunks, []) == out[0].tolist()


def test_generate_rejects_batches(medusa):
    with pytest.raises(ValueError, match="batch size 1"):
        medusa.generate(torch.ones(2, 3, dtype=torch.long))
