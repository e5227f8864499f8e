"""Heads exported for vLLM's Medusa carry exactly the names vLLM loads (it drops unknown ones silently)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference import convert_medusa
from inference.runtime.vllm_export import VllmExportError, check_vllm_names, export_vllm, vllm_parameter_names
from medusa_helpers import random_heads, upper_half_vocab
from medusa_model import MedusaModel, save_heads


@pytest.mark.parametrize("layout,draft", [("shared_lm_head", False), ("shared_lm_head", True), ("own_lm_head", False)])
def test_export_holds_every_vllm_parameter_and_nothing_else(tiny_pangu, tmp_path, layout, draft):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=3, layout=layout, draft_vocab=upper_half_vocab(model) if draft else None)
    export_vllm(heads, model.lm_head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert not [key for key in config if "num" in key and key not in ("num_heads", "num_hidden_layers")]
    assert (config["num_heads"], config["num_hidden_layers"], config["original_lm_head"]) == (3, 1, layout == "shared_lm_head")
    state = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(state["blocks.2.layers.0.weight"], heads[2][0].linear.weight)
    assert torch.equal(state["blocks.2.layers.0.bias"], heads[2][0].linear.bias)
    if layout == "own_lm_head":
        assert torch.equal(state["lm_heads.1.weight"], heads[1][1].weight)
    else:
        assert torch.equal(state["lm_heads.0.weight"], model.lm_head.weight)
    assert "token_map" not in state and "truncated_vocab_size" not in config  # vLLM 0.32 cannot load one
    assert "lm_head.weight" in vllm_parameter_names(config) or layout == "own_lm_head"


def test_a_name_vllm_would_drop_or_miss_is_an_error(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    export_vllm(random_heads(model, num_heads=2), model.lm_head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["medusa_head.0.0.linear.weight"] = state.pop("blocks.0.layers.0.weight")  # upstream's name, unknown to vLLM
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(VllmExportError, match=r"drop \['medusa_head.0.0.linear.weight'\].*blocks.0.layers.0.weight"):
        check_vllm_names(tmp_path)


def test_an_extra_tensor_alone_or_a_missing_one_alone_is_an_error(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    export_vllm(random_heads(model, num_heads=2), model.lm_head, tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    save_file(state | {"token_map": torch.arange(4)}, str(weights))
    with pytest.raises(VllmExportError, match=r"drop \['token_map'\] and leave \[\] uninitialised"):
        check_vllm_names(tmp_path)
    save_file({k: v for k, v in state.items() if k != "blocks.1.layers.0.bias"}, str(weights))
    with pytest.raises(VllmExportError, match=r"drop \[\] and leave \['blocks.1.layers.0.bias'\] uninitialised"):
        check_vllm_names(tmp_path)
    save_file(state, str(weights))
    check_vllm_names(tmp_path)


@pytest.mark.parametrize("head_input", ["hidden_and_next_token", "hidden_and_path"])
def test_heads_that_read_tokens_are_refused_with_what_vllm_supports(tiny_pangu, tmp_path, head_input):
    model = tiny_pangu[1]
    with pytest.raises(VllmExportError, match=f"hidden state only.*{head_input}"):
        export_vllm(random_heads(model, num_heads=2, head_input=head_input), model.lm_head, tmp_path)


def test_convert_medusa_writes_the_vllm_layout_and_refuses_next_token_heads(tiny_pangu, tmp_path, capsys):
    directory, model = tiny_pangu
    for name, head_input in (("plain", "hidden"), ("next", "hidden_and_next_token")):
        heads = random_heads(model, num_heads=2, head_input=head_input)
        heads.config.base_model_name_or_path = str(directory)
        save_heads(heads, tmp_path / name)
    assert convert_medusa.main(["--medusa_dir", str(tmp_path / "plain"), "--out", str(tmp_path / "vllm"),
                                "--layout", "vllm", "--dtype", "fp32"]) == 0
    check_vllm_names(tmp_path / "vllm")
    assert convert_medusa.main(["--medusa_dir", str(tmp_path / "next"), "--out", str(tmp_path / "no"),
                                "--layout", "vllm"]) == 2
    assert "error: vLLM's Medusa runs heads that read the hidden state only" in capsys.readouterr().err
    assert MedusaModel.from_pretrained(None, str(tmp_path / "plain"), device="cpu", dtype="fp32",
                                       tree="chain_2").medusa_head.num_heads == 2
