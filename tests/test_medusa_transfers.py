"""A Medusa step makes exactly one device-to-host transfer (host syncs are what kill speculative speed-ups)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from inference.decoding import DecodeRequest
from inference.medusa_decoding import MedusaDecoder
from inference.plain_decoding import plain_decode
from medusa_choices import load_tree
from medusa_helpers import random_heads, random_prompts, upper_half_vocab

# Every way a tensor's value reaches Python (on an accelerator each one waits for the device).
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__len__"}


class HostReadCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def reads_per_step(steps) -> list[int]:
    counter, per_step = HostReadCounter(), []
    with counter:
        for _ in steps:
            per_step.append(counter.count)
            counter.count = 0
    return per_step


def test_counter_sees_a_host_read():
    counter = HostReadCounter()
    with counter:
        if torch.ones(1) > 0:
            torch.arange(3).tolist()
    assert counter.count == 2


@pytest.mark.parametrize("head_input,draft", [("hidden", False), ("hidden_and_next_token", False),
                                              ("hidden_and_next_token", True)])
def test_each_medusa_step_reads_the_device_once(tiny_pangu, head_input, draft):
    model = tiny_pangu[1]
    draft_vocab = upper_half_vocab(model) if draft else None
    decoder = MedusaDecoder(model, random_heads(model, head_input=head_input, draft_vocab=draft_vocab))
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    per_step = reads_per_step(decoder.decode(DecodeRequest(prompt, 60), load_tree("mc_sim_7b_63")))
    assert len(per_step) > 10
    assert per_step[1:] == [1] * (len(per_step) - 1)  # [0] is the prefill


def test_each_plain_step_reads_the_device_once(tiny_pangu):
    model = tiny_pangu[1]
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    per_step = reads_per_step(plain_decode(model, DecodeRequest(prompt, 20)))
    assert per_step[1:] == [1] * 19
