import json
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from openpangu_model import PanguEmbeddedConfig, PanguEmbeddedForCausalLM
from tiny_pangu import random_model, tiny_config

IDS = torch.tensor([[1, 5, 17, 99, 3, 250, 42, 7, 7, 300, 11, 64]])


def llama_twin(model: PanguEmbeddedForCausalLM) -> LlamaForCausalLM:
    c = model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_parameters["rope_theta"], attention_bias=True,
        tie_word_embeddings=False,
    )
    twin = LlamaForCausalLM(config).float().eval()
    twin.load_state_dict(model.state_dict())
    return twin


def test_logits_equal_llama_with_attention_bias():
    model = random_model(tiny_config())
    with torch.no_grad():
        diff = (model(IDS).logits - llama_twin(model)(IDS).logits).abs().max().item()
    assert diff <= 1e-5


def test_qkvo_projections_have_bias_and_mlp_has_none():
    layer = random_model(tiny_config()).model.layers[0]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert getattr(layer.self_attn, proj).bias is not None
    assert layer.mlp.gate_proj.bias is None and layer.mlp.down_proj.bias is None


@pytest.mark.parametrize("field,other", [("rope_theta", 1e4), ("rms_norm_eps", 1e-1)])
def test_rope_theta_and_eps_change_the_logits(field, other):
    model = random_model(tiny_config())
    changed = random_model(tiny_config(**{field: other}))
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (model(IDS).logits - changed(IDS).logits).abs().max() > 1e-5  # parity tolerance


def test_config_defaults_are_openpangu_7b_and_tolerate_missing_keys():
    config = PanguEmbeddedConfig()
    assert (config.vocab_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        153376, 34, 32, 8)
    assert config.rope_parameters["rope_theta"] == 1.6e7
    assert config.head_dim == 128 and config.attention_dropout == 0.0 and config.attention_bias
    assert config.eos_token_id == 45892 and not config.tie_word_embeddings


def test_sharded_checkpoint_loads_through_auto_classes_without_remote_code(tiny_pangu, caplog):
    directory, model = tiny_pangu
    config_json = json.loads((directory / "config.json").read_text())
    assert "auto_map" in config_json and "head_dim" not in config_json
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4
    assert [k for k, v in index["weight_map"].items() if v == shards[-1]] == ["lm_head.weight"]
    assert sum("rotary_emb.inv_freq" in k for k in index["weight_map"]) == model.config.num_hidden_layers

    config = AutoConfig.from_pretrained(directory)
    assert isinstance(config, PanguEmbeddedConfig) and config.rope_parameters["rope_theta"] == 1.6e7
    with caplog.at_level(logging.WARNING):
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert isinstance(loaded, PanguEmbeddedForCausalLM)
    assert not [r for r in caplog.records if "inv_freq" in r.getMessage() or "UNEXPECTED" in r.getMessage()]
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_save_and_reload_round_trip(tiny_pangu, tmp_path):
    _, model = tiny_pangu
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)
