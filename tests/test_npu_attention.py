"""The NPU fused-attention path, run on CPU through a fake `torch_npu` kernel with the real semantics."""

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.engine.decoding import DecodeRequest
from inference.engine.medusa_decoding import MedusaDecoder
from inference.engine.npu_attention import NPU_ATTENTION, use_npu_attention
from medusa_choices import load_tree
from medusa_helpers import hf_greedy, random_heads, random_prompts


def fake_fused_infer_attention_score(query, key, value, *, atten_mask=None, num_heads=1, num_key_value_heads=0,
                                     input_layout="BSH", scale=1.0, sparse_mode=0, calls=None):
    """Reference semantics of the kernel: BNSD layout, GQA, atten_mask True = masked out."""
    assert input_layout == "BNSD" and sparse_mode == 0
    assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    assert query.shape[1] == num_heads and key.shape[1] == num_key_value_heads
    groups = num_heads // num_key_value_heads
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scale
    if atten_mask is not None:
        assert atten_mask.dtype == torch.bool
        calls.append(atten_mask)
        scores = scores.masked_fill(atten_mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(query.dtype) @ value, None


@pytest.fixture
def npu_model(tiny_pangu, monkeypatch):
    calls = []
    module = types.ModuleType("torch_npu")
    module.npu_fused_infer_attention_score = lambda *a, **k: fake_fused_infer_attention_score(*a, calls=calls, **k)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    model = AutoModelForCausalLM.from_pretrained(tiny_pangu[0], dtype=torch.float32).eval()
    use_npu_attention(model)
    assert model.config._attn_implementation == NPU_ATTENTION
    return model, calls


def test_fused_attention_logits_equal_the_reference_model(npu_model, tiny_pangu):
    model, calls = npu_model
    ids = torch.tensor([random_prompts(model.config.vocab_size, count=1)[0]])
    with torch.no_grad():
        diff = (model(ids).logits - tiny_pangu[1](ids).logits).abs().max().item()
    assert diff < 1e-5
    assert calls and calls[0].any()  # the causal mask reached the kernel, inverted (True = hidden)


def test_medusa_tree_verification_through_the_fused_kernel_is_exact(npu_model, tiny_pangu):
    model, calls = npu_model
    decoder = MedusaDecoder(model, random_heads(model))
    for prompt in random_prompts(model.config.vocab_size, count=3):
        out = [t for s in decoder.decode(DecodeRequest(prompt, 40), load_tree("mc_sim_7b_63")) for t in s]
        assert out == hf_greedy(tiny_pangu[1], prompt, 40)
    tree_masks = [m for m in calls if m.shape[-2] == 64]
    assert tree_masks and all(m.dtype == torch.bool for m in tree_masks)
