"""A decoding step reads the device once, explicitly: no hidden synchronisation (each one stalls an
accelerator's pipeline), and the step's shapes do not depend on how many tokens were accepted."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from inference.engine.decoding import DecodeRequest
from inference.engine.forward import StaticCache
from inference.engine.medusa_decoding import Acceptance, MedusaDecoder, default_rule
from inference.engine.plain_decoding import plain_decode
from inference.engine.sampling import Sampling
from medusa_choices import load_tree
from medusa_helpers import ScriptedSchedule, random_heads, random_prompts, upper_half_vocab

# What the profiler shows for every implicit device-to-host read (.item(), 0-d tensor indexing, bool(t),
# multinomial's checks, boolean masks); an explicit .tolist() does not show.
HIDDEN_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")
SAMPLED = Sampling(temperature=0.8, top_p=0.9)


def hidden_syncs_after_prefill(steps) -> tuple[int, int]:
    """(hidden syncs, steps) over every step after the prefill."""
    iterator = iter(steps)
    next(iterator)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        count = sum(1 for _ in iterator)
    return sum(e.count for e in prof.key_averages() if e.key in HIDDEN_SYNCS), count


def test_the_profiler_sees_a_hidden_sync():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(2)[0].item()
        torch.arange(3).tolist()
    assert [e.count for e in prof.key_averages() if e.key in HIDDEN_SYNCS] == [1]


@pytest.mark.parametrize("rule,sampling", [("greedy", Sampling()), ("sample", SAMPLED), ("typical", SAMPLED)])
@pytest.mark.parametrize("head_input,draft,tree", [("hidden", False, "mc_sim_7b_63"),
                                                   ("hidden_and_next_token", False, "mc_sim_7b_63"),
                                                   ("hidden_and_next_token", True, "mc_sim_7b_63"),
                                                   ("hidden_and_path", True, "mc_sim_7b_63"),
                                                   ("hidden_and_path", True, "dynamic:16"),
                                                   ("features", True, "dynamic:16")])
def test_medusa_steps_make_no_hidden_sync(pangu_on_device, rule, sampling, head_input, draft, tree):
    model = pangu_on_device
    draft_vocab = upper_half_vocab(model) if draft else None
    decoder = MedusaDecoder(model, random_heads(model, head_input=head_input, draft_vocab=draft_vocab))
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    request = DecodeRequest(prompt, 40, (), sampling, seed=0)
    syncs, steps = hidden_syncs_after_prefill(decoder.decode(request, load_tree(tree), Acceptance(rule)))
    assert steps > 5 and syncs == 0


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED])
@pytest.mark.parametrize("head_input", ["hidden_and_path", "features"])
def test_steps_a_schedule_switches_between_make_no_hidden_sync(pangu_on_device, sampling, head_input):
    model = pangu_on_device
    decoder = MedusaDecoder(model, random_heads(model, head_input=head_input))
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    fixed = [load_tree("mc_sim_7b_63")] if head_input != "features" else []  # the feature drafter drafts dynamic trees
    schedule = ScriptedSchedule([load_tree("dynamic:16"), None, load_tree("dynamic:8"), *fixed])
    request = DecodeRequest(prompt, 40, (), sampling, seed=0)
    syncs, steps = hidden_syncs_after_prefill(decoder.decode(request, schedule, Acceptance(default_rule(sampling.temperature))))
    assert steps > 10 and syncs == 0


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED])
def test_plain_steps_make_no_hidden_sync(pangu_on_device, sampling):
    model = pangu_on_device
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    syncs, steps = hidden_syncs_after_prefill(plain_decode(model, DecodeRequest(prompt, 20, (), sampling, seed=0)))
    assert steps == 19 and syncs == 0


def test_the_kv_keep_has_the_same_shape_whatever_is_accepted(pangu_on_device, monkeypatch):
    model = pangu_on_device
    widths = []
    real_keep = StaticCache.keep

    def spy(self, start, nodes):
        widths.append(tuple(nodes.shape))
        real_keep(self, start, nodes)

    monkeypatch.setattr(StaticCache, "keep", spy)
    decoder = MedusaDecoder(model, random_heads(model, num_heads=4, std=0.5))
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    steps = list(decoder.decode(DecodeRequest(prompt, 60), load_tree("mc_sim_7b_63")))
    assert set(widths) == {(5,)}  # depth + 1 for the 4-level tree
    assert len({len(step) for step in steps[1:-1]}) > 1  # while the accepted lengths varied


class TransferCounter:
    """Counts the explicit device-to-host reads of tensors: `.tolist()`, `.item()`, `.cpu()`, `.numpy()`."""

    READS = ("tolist", "item", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.counts = dict.fromkeys(self.READS, 0)
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))

    def _counting(self, name, read):
        def counted(tensor, *args, **kwargs):
            self.counts[name] += 1
            return read(tensor, *args, **kwargs)

        return counted


@pytest.mark.parametrize("rule,sampling,head_input,tree", [("greedy", Sampling(), "hidden", "mc_sim_7b_63"),
                                                           ("sample", SAMPLED, "hidden_and_next_token", "tree_16"),
                                                           ("greedy", Sampling(), "hidden_and_path", "dynamic:16"),
                                                           ("sample", SAMPLED, "hidden_and_path", "dynamic:16"),
                                                           ("sample", SAMPLED, "hidden_and_path", "switching"),
                                                           ("sample", SAMPLED, "features", "dynamic:16"),
                                                           ("greedy", Sampling(), "features", "switching")])
def test_each_medusa_step_reads_the_device_exactly_once(pangu_on_device, monkeypatch, rule, sampling, head_input,
                                                        tree):
    model = pangu_on_device
    decoder = MedusaDecoder(model, random_heads(model, head_input=head_input))
    prompt = random_prompts(model.config.vocab_size, count=1)[0] * 3  # repeated text, so context lookup guesses
    other = load_tree("dynamic:8" if head_input == "features" else "tree_16")
    steps_of = ScriptedSchedule([load_tree("dynamic:16"), None, other]) if tree == "switching" else load_tree(tree)
    transfers = TransferCounter(monkeypatch)
    steps = len(list(decoder.decode(DecodeRequest(prompt, 40, (), sampling, seed=0), steps_of, Acceptance(rule))))
    assert steps > 5 and transfers.counts == {"tolist": steps, "item": 0, "cpu": 0, "numpy": 0}  # prefill included


def test_each_plain_step_reads_the_device_exactly_once(pangu_on_device, monkeypatch):
    model = pangu_on_device
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    transfers = TransferCounter(monkeypatch)
    steps = len(list(plain_decode(model, DecodeRequest(prompt, 20, (), SAMPLED, seed=0))))
    assert steps == 20 and transfers.counts == {"tolist": 20, "item": 0, "cpu": 0, "numpy": 0}
