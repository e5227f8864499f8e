"""The NPU fused-attention path, run on CPU through a fake `torch_npu` kernel with the real semantics."""

import copy
import sys
import types

import pytest
import torch

from inference.engine.decoding import DecodeRequest
from inference.engine.forward import float32_attention, masked_attention
from inference.engine.medusa_decoding import MedusaDecoder
from inference.engine import npu_attention
from inference.engine.npu_attention import attention_for, npu_fused_attention
from inference.engine.plain_decoding import PlainDecoder
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
    assert atten_mask is not None and atten_mask.dtype == torch.bool
    calls.append(atten_mask)
    scores = scores.masked_fill(atten_mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(query.dtype) @ value, None


@pytest.fixture
def fused_kernel_calls(monkeypatch):
    calls = []
    module = types.ModuleType("torch_npu")
    module.npu_fused_infer_attention_score = lambda *a, **k: fake_fused_infer_attention_score(*a, calls=calls, **k)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return calls


def test_npu_devices_attend_through_the_fused_kernel():
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") exists only with torch_npu
    assert attention_for(npu, torch.bfloat16) is npu_fused_attention
    assert attention_for(torch.device("cpu"), torch.bfloat16) is not npu_fused_attention


@pytest.mark.parametrize("amx, dtype, expected", [(False, torch.bfloat16, float32_attention),
                                                  (True, torch.bfloat16, masked_attention),
                                                  (False, torch.float32, masked_attention)])
def test_bf16_steps_attend_in_float32_over_a_float32_cache_on_cpus_without_amx(monkeypatch, tiny_pangu, amx, dtype, expected):
    monkeypatch.setattr(npu_attention, "amx_cpu", lambda: amx)
    model = copy.deepcopy(tiny_pangu[1]).to(dtype)
    cache_dtype = torch.float32 if expected is float32_attention else dtype  # widened once, when written
    for decoder in (PlainDecoder(model), MedusaDecoder(model, random_heads(model).to(dtype))):
        assert decoder.attention is expected
        assert {t.dtype for t in decoder.cache.get(8).keys + decoder.cache.get(8).values} == {cache_dtype}


def test_plain_decoding_through_the_fused_kernel_equals_hf_greedy(fused_kernel_calls, tiny_pangu):
    model = tiny_pangu[1]
    decoder = PlainDecoder(model, attention=npu_fused_attention)
    for prompt in random_prompts(model.config.vocab_size, count=2):
        out = [t for s in decoder.decode(DecodeRequest(prompt, 20)) for t in s]
        assert out == hf_greedy(model, prompt, 20)
    # the unwritten part of the cache reached the kernel as masked (True = hidden)
    assert fused_kernel_calls and fused_kernel_calls[0][..., -1].all()


def test_medusa_tree_verification_through_the_fused_kernel_is_exact(fused_kernel_calls, tiny_pangu):
    model = tiny_pangu[1]
    decoder = MedusaDecoder(model, random_heads(model), attention=npu_fused_attention)
    for prompt in random_prompts(model.config.vocab_size, count=3):
        out = [t for s in decoder.decode(DecodeRequest(prompt, 40), load_tree("mc_sim_7b_63")) for t in s]
        assert out == hf_greedy(model, prompt, 40)
    tree_masks = [m for m in fused_kernel_calls if m.shape[-2] == 64]
    assert tree_masks and all(m.dtype == torch.bool for m in tree_masks)
