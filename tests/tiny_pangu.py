"""Tiny OpenPangu-Embedded checkpoints in the real on-disk layout, for tests.

The real checkpoint is bf16 safetensors in shards with an index, a layer may straddle two shards, the
last shard may hold only lm_head, and every layer carries a legacy fp32 `rotary_emb.inv_freq` buffer.
The tokenizer is a SentencePiece model with `[unusedN]` control pieces; here a small one is trained
with the same special tokens so that ids, chat rendering and round trips can be checked exactly.
"""

import io
import json
from pathlib import Path

import sentencepiece as spm
import torch
from safetensors.torch import save_file

from openpangu_model import PanguEmbeddedConfig, PanguEmbeddedForCausalLM

UNUSED = [f"[unused{i}]" for i in range(34)]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer for tests.",
    "Medusa heads propose tokens and the base model verifies them in one pass.",
    "系统 用户 助手 工具 方法 你好 世界 中国 北京 模型 推理",
    "def add(a, b):\n    return a + b",
    "1 2 3 4 5 6 7 8 9 0 + - * / = ( ) [ ] { } : ; , . ! ?",
] * 20


def train_sentencepiece(path: Path, vocab_size: int = 512) -> Path:
    """Train a byte-fallback unigram model with Pangu's special pieces: unk 0, bos 1, eos 2."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        byte_fallback=True,
        user_defined_symbols=UNUSED,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return path


def write_tokenizer(directory: Path) -> None:
    """tokenizer.model + tokenizer_config.json as OpenPangu ships them (remote-code auto_map included)."""
    directory.mkdir(parents=True, exist_ok=True)
    train_sentencepiece(directory / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    special = ["<unk>", "<s>", "</s>"] + UNUSED
    added = {
        str(sp.piece_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for tok in special
    }
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_openpangu.PanguTokenizer", None]},
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[unused10]",
        "legacy": True,
        "pad_token": "<unk>",
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "PanguTokenizer",
        "unk_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))


def tiny_config(vocab_size: int = 512, **overrides) -> PanguEmbeddedConfig:
    """A 4-layer GQA (4 query / 2 KV heads) model with biases and rope_theta 1.6e7."""
    values = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=1.6e7,
        bias=True,
        eos_token_id=None,
        initializer_range=0.1,  # at 0.02 a random model repeats one token forever
    )
    values.update(overrides)
    return PanguEmbeddedConfig(**values)


def random_model(config: PanguEmbeddedConfig, seed: int = 0) -> PanguEmbeddedForCausalLM:
    """Random weights with non-zero biases and norms, so every parameter influences the logits."""
    torch.manual_seed(seed)
    model = PanguEmbeddedForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def write_sharded_checkpoint(model: PanguEmbeddedForCausalLM, directory: Path, num_shards: int = 4) -> None:
    """Save like the real OpenPangu-Embedded-7B: bf16 shards + index, lm_head alone in the last shard,
    shard cuts inside layers, legacy inv_freq keys, remote-code auto_map in config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    head_dim = model.config.head_dim
    inv_freq = 1.0 / (model.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    for layer in range(model.config.num_hidden_layers):
        state[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    body = [k for k in state if k != "lm_head.weight"]
    per_shard = -(-len(body) // (num_shards - 1))
    groups = [body[i : i + per_shard] for i in range(0, len(body), per_shard)] + [["lm_head.weight"]]
    weight_map = {}
    for index, keys in enumerate(groups, start=1):
        name = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k] for k in keys}, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = model.config.to_dict()
    config["architectures"] = ["PanguEmbeddedForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_openpangu_dense.PanguEmbeddedConfig",
        "AutoModel": "modeling_openpangu_dense.PanguEmbeddedModel",
        "AutoModelForCausalLM": "modeling_openpangu_dense.PanguEmbeddedForCausalLM",
    }
    config["torch_dtype"] = "bfloat16"
    # The real config.json predates these keys; loading must not need them.
    for key in ("head_dim", "attention_dropout", "attention_bias", "mlp_bias", "rope_parameters"):
        config.pop(key, None)
    config["rope_theta"] = model.config.rope_parameters["rope_theta"]
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def write_tiny_pangu(directory: Path, seed: int = 0, **overrides) -> PanguEmbeddedForCausalLM:
    """A complete tiny OpenPangu-Embedded directory (weights, config, tokenizer); returns the fp32 model
    with bf16-rounded weights, i.e. exactly what loading the directory in fp32 gives."""
    write_tokenizer(directory)
    vocab = spm.SentencePieceProcessor(model_file=str(directory / "tokenizer.model")).get_piece_size()
    model = random_model(tiny_config(vocab_size=vocab, **overrides), seed=seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    write_sharded_checkpoint(model, directory)
    return model
