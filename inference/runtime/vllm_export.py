"""Drafters in the directory layouts vLLM's speculators load: Medusa heads for `{"method": "medusa"}`, the feature
drafter for `{"method": "eagle"}`.

vLLM's Medusa drafts a top-1 chain from the base model's last hidden state: heads that read the hidden
state only (`medusa_head_input="hidden"`), each `num_hidden_layers` residual blocks and a vocabulary
projection. Its loader keeps only the tensor names it knows and silently drops the rest (heads then run
with random weights), and its config reader renames every key containing "num" and "heads"/"layers".
So the export writes the Medusa keys only, and reads the result back to check every name against
vLLM's naming before it is called done.

A draft vocabulary is not exported: vLLM's loader takes `token_map` but never reports it loaded, so
vLLM 0.32 refuses such a directory ("Following weights were not initialized from checkpoint:
{'token_map'}"). vLLM's heads then score over the whole shared lm_head, which the heads were trained with.

The feature drafter is written as vLLM's `EagleLlamaForCausalLM` loads it (model_executor/models/llama_eagle.py):
a Llama config of the drafter's layers (vLLM prefixes the architecture with "Eagle"), `fc.weight` and
`layers.{i}.*`, the first with no input norm (vLLM replaces it with the identity), the embeddings and lm_head
taken from the served model. Its draft vocabulary is left out for the same reason as above (EAGLE-1 in vLLM
reads none): vLLM scores its proposals over the whole lm_head.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from inference.runtime.medusa_heads import MedusaHeads
from inference.runtime.outputs import replace_atomic, write_atomic

VLLM_WEIGHTS = "model.safetensors"


class VllmExportError(ValueError):
    """Heads vLLM cannot run, or an export whose names vLLM would not load."""


def check_vllm_can_run(heads: MedusaHeads) -> None:
    config = heads.config
    if config.medusa_head_input != "hidden":
        raise VllmExportError(
            f"vLLM's Medusa runs heads that read the hidden state only; these heads use medusa_head_input="
            f"{config.medusa_head_input!r} (they also read tokens after t). Train heads with --head_input hidden "
            "to serve them with vLLM, or serve these with this project's engine")


def vllm_config(heads: MedusaHeads, hidden_size: int, vocab_size: int) -> dict:
    """The config.json vLLM's MedusaConfig reads: Medusa keys only, nothing it would rename by mistake."""
    config = heads.config
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "num_heads": config.medusa_num_heads,
        "num_hidden_layers": config.medusa_num_layers,
        "medusa_fc_bias": True,  # our ResBlocks carry a bias
        "original_lm_head": not heads.own_lm_head,
    }


def vllm_state_dict(heads: MedusaHeads, lm_head: torch.nn.Linear) -> dict[str, torch.Tensor]:
    """vLLM's tensor names: `blocks.{i}.layers.{j}.weight/bias` and the projection(s)."""
    state = {}
    layers = heads.config.medusa_num_layers
    for i, head in enumerate(heads):
        for j in range(layers):
            state[f"blocks.{i}.layers.{j}.weight"] = head[j].linear.weight
            state[f"blocks.{i}.layers.{j}.bias"] = head[j].linear.bias
        if heads.own_lm_head:
            state[f"lm_heads.{i}.weight"] = head[layers].weight
    if not heads.own_lm_head:
        state["lm_heads.0.weight"] = lm_head.weight  # the shared lm_head, which vLLM reads under this name
    return {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}


def vllm_parameter_names(config: dict) -> set[str]:
    """The parameters vLLM's Medusa model has for `config`."""
    names = {f"blocks.{i}.layers.{j}.{kind}" for i in range(config["num_heads"])
             for j in range(config["num_hidden_layers"])
             for kind in (("weight", "bias") if config.get("medusa_fc_bias") else ("weight",))}
    if config.get("original_lm_head"):
        return names | {"lm_head.weight"}
    return names | {f"lm_heads.{i}.weight" for i in range(config["num_heads"])}


def check_vllm_names(directory: Path) -> None:
    """Every tensor in the export is one vLLM loads, and every vLLM parameter gets one (no silent drop)."""
    config = json.loads((directory / "config.json").read_text())
    names = set(load_file(str(directory / VLLM_WEIGHTS)))
    if config.get("original_lm_head"):  # vLLM reads the shared projection under this name
        names = (names - {"lm_heads.0.weight"}) | ({"lm_head.weight"} if "lm_heads.0.weight" in names else set())
    expected = vllm_parameter_names(config)
    if names != expected:
        raise VllmExportError(f"{directory}: vLLM would drop {sorted(names - expected)} and leave "
                              f"{sorted(expected - names)} uninitialised")


def eagle_config(drafter, base_config) -> dict:
    """The draft model config vLLM's EAGLE reads: a Llama of the drafter's layers and the base's RoPE."""
    fields = drafter.config.medusa_feature_layer
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": base_config.hidden_size,
        "vocab_size": base_config.vocab_size,
        "num_hidden_layers": len(drafter.layers),
        "max_position_embeddings": base_config.max_position_embeddings,
        "tie_word_embeddings": False,
        **fields,
    }
    rope = dict(getattr(base_config, "rope_parameters", None) or getattr(base_config, "rope_scaling", None) or {})
    config["rope_theta"] = rope.pop("rope_theta", getattr(base_config, "rope_theta", None))
    if rope.get("rope_type", "default") != "default":  # older transformers (vLLM's) read scaling from rope_scaling
        config["rope_scaling"] = rope
    return config


def eagle_parameter_names(config: dict) -> set[str]:
    """The tensors vLLM's EAGLE Llama loads from a draft directory of `config` (embeddings and lm_head shared;
    the first layer has no input norm)."""
    kinds = ("weight", "bias") if config["attention_bias"] else ("weight",)
    names = {"fc.weight"}
    for index in range(config["num_hidden_layers"]):
        layer = f"layers.{index}."
        names |= {layer + "post_attention_layernorm.weight"} | ({layer + "input_layernorm.weight"} if index else set())
        names |= {f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"{layer}self_attn.{p}_proj.{k}" for p in "qkvo" for k in kinds}
    return names


def export_eagle(drafter, base_config, directory: Path) -> None:
    if drafter.aux_layers:
        raise VllmExportError("a fused feature drafter (medusa_feature_aux_layers) has no vLLM layout: vLLM's `eagle` "
                              "reads the final hidden states only, and its `eagle3` another layer design")
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items() if k != "draft_vocab"}
    config = eagle_config(drafter, base_config)
    replace_atomic(directory / VLLM_WEIGHTS, lambda staging: save_file(state, str(staging), metadata={"format": "pt"}))
    write_atomic(directory / "config.json", json.dumps(config, indent=2) + "\n")
    names, expected = set(load_file(str(directory / VLLM_WEIGHTS))), eagle_parameter_names(config)
    if names != expected:
        raise VllmExportError(f"{directory}: vLLM would drop {sorted(names - expected)} and leave "
                              f"{sorted(expected - names)} uninitialised")


def export_vllm(heads, lm_head: torch.nn.Linear, directory: str | Path, base_config=None) -> None:
    """Write `heads` (on the base whose `lm_head` and config are given) as a vLLM Medusa directory, or a feature
    drafter as a vLLM EAGLE directory, then check its names."""
    directory = Path(directory)
    if heads.config.medusa_head_input == "features":
        directory.mkdir(parents=True, exist_ok=True)
        export_eagle(heads, base_config, directory)
        return
    check_vllm_can_run(heads)
    directory.mkdir(parents=True, exist_ok=True)
    config = vllm_config(heads, lm_head.in_features, lm_head.out_features)
    state = vllm_state_dict(heads, lm_head)
    replace_atomic(directory / VLLM_WEIGHTS, lambda staging: save_file(state, str(staging), metadata={"format": "pt"}))
    write_atomic(directory / "config.json", json.dumps(config, indent=2) + "\n")
    check_vllm_names(directory)
