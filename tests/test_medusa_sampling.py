"""Sampling through the tree is lossless: continuations are distributed exactly as plain sampling."""

import itertools
import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference.engine.context_lookup import ContextLookup
from inference.engine.decoding import DecodeRequest, DecodeStats
from inference.engine.medusa_decoding import Acceptance, MedusaDecoder
from inference.engine.sampling import Sampling, probabilities
from medusa_choices import DynamicTree, load_tree
from medusa_helpers import ScriptedSchedule, random_heads

VOCAB, LENGTH, SAMPLES = 6, 3, 3000
PROMPT = [1, 4, 2]
SAMPLING = Sampling(temperature=0.9, top_p=0.95)


def tiny_vocab_model() -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_bias=True, initializer_range=0.3, eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(config).float().eval()


@torch.no_grad()
def exact_distribution(model) -> dict[tuple, float]:
    """P(continuation) under plain sampling, by enumerating every continuation of LENGTH tokens."""
    result = {}
    for continuation in itertools.product(range(VOCAB), repeat=LENGTH):
        logits = model(torch.tensor([PROMPT + list(continuation[:-1])], device=model.device)).logits[0, len(PROMPT) - 1 :]
        probs = probabilities(logits, SAMPLING)
        result[continuation] = math.prod(probs[i, t].item() for i, t in enumerate(continuation))
    return result


def chi_square_critical(df: int) -> float:
    """The chi-square quantile at p = 0.999 (Wilson-Hilferty approximation)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square_rejects(counts: Counter, expected: dict[tuple, float], n: int) -> tuple[float, float]:
    """Pearson chi-square (cells with expected count < 5 pooled) and its 0.1% critical value."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        if p * n >= 5:
            stat += (counts[cell] - p * n) ** 2 / (p * n)
            cells += 1
        else:
            pooled_obs += counts[cell]
            pooled_exp += p * n
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, chi_square_critical(cells - 1)


# Two of the six tokens at the first level: a root draw is often not among the proposals, so steps that accept
# nothing, second steps and the KV keep after a sampled step all happen. The dynamic tree is chosen per step,
# from the heads alone or with the context-lookup chain competing for its nodes; or a schedule switches between
# trees of two sizes and plain steps.
@pytest.mark.parametrize("tree,head_input", [
    ([[0], [1], [0, 0]], "hidden"),
    (DynamicTree(nodes=3, top_k=2, expand=1, lookup=0), "hidden_and_path"),
    (DynamicTree(nodes=3, top_k=2, expand=1, lookup=3), "hidden_and_path"),
    (ScriptedSchedule([DynamicTree(nodes=3, top_k=2, expand=1, lookup=3), None,
                       DynamicTree(nodes=2, top_k=2, expand=1, lookup=0)]), "hidden_and_path"),
    (DynamicTree(nodes=3, top_k=2, expand=1, lookup=3), "features"),
    (ScriptedSchedule([DynamicTree(nodes=3, top_k=2, expand=1, lookup=0), None,
                       DynamicTree(nodes=2, top_k=2, expand=1, lookup=3)]), "features"),
], ids=["fixed", "dynamic", "dynamic-lookup", "switching", "feature-drafter", "feature-drafter-switching"])
def test_sampled_continuations_match_plain_sampling_distribution(tree, head_input):
    model = tiny_vocab_model()
    expected = exact_distribution(model)
    decoder = MedusaDecoder(model, random_heads(model, num_heads=2, std=0.5, head_input=head_input))
    counts, stats = Counter(), DecodeStats()
    for seed in range(SAMPLES):
        request = DecodeRequest(PROMPT, LENGTH, (), SAMPLING, seed=seed)
        counts[tuple(t for step in decoder.decode(request, tree, Acceptance("sample"), stats) for t in step)] += 1
    assert stats.accept_lengths[2] > SAMPLES // 10  # speculation accepted a candidate in many draws
    assert stats.steps > SAMPLES * 1.2  # and many draws needed a second step (nothing accepted in the first)
    stat, critical = chi_square_rejects(counts, expected, SAMPLES)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: Medusa sampling is not lossless"


# A model whose every token has the same embedding, so every position's next token is drawn from one fixed
# distribution: a sampled text is then a sequence of independent draws, whose pairs a chi-square can check
# however the draws were grouped into steps. Flat enough that no token is rare, so a bias on any shows.
UNIGRAM = torch.tensor([0.3, 0.22, 0.17, 0.13, 0.1, 0.08])


def unigram_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(UNIGRAM), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.randn(config.hidden_size).expand(len(UNIGRAM), -1))
        hidden = model.model(input_ids=torch.tensor([[0]])).last_hidden_state[0, 0]
        model.lm_head.weight.copy_(UNIGRAM.log().unsqueeze(1) * hidden / hidden.dot(hidden))  # logits = log UNIGRAM
    return model


def pair_chi_square(sequences: list[list[int]]) -> tuple[float, float]:
    """Pearson chi-square of the counts of consecutive token pairs against independent UNIGRAM draws (a
    Markov chain goodness-of-fit test, every row against UNIGRAM), and its 0.1% critical value."""
    pairs = Counter(pair for sequence in sequences for pair in zip(sequence, sequence[1:]))
    size, stat = len(UNIGRAM), 0.0
    for first in range(size):
        row = sum(pairs[(first, second)] for second in range(size))
        for second in range(size):
            expected = row * UNIGRAM[second].item()
            stat += (pairs[(first, second)] - expected) ** 2 / expected
    return stat, chi_square_critical(size * (size - 1))


def always_the_likeliest_token(self, count: int) -> tuple[list[int], list[float]]:
    """A context lookup that always guesses the likeliest token, surely: its chain repeats a head's node at
    every step, and its first token is the one drawn most often there."""
    return [int(UNIGRAM.argmax())] * count, [math.log(0.9) * (k + 1) for k in range(count)]


FULL_LEVEL = dict(top_k=len(UNIGRAM), expand=len(UNIGRAM))  # every token is a level-1 candidate
REPEATING_TREES = [
    ([[0], [1], [0, 0], [1, 0]], "hidden", "shared_lm_head", False),
    ([[0], [1], [0, 0], [1, 0]], "hidden", "own_lm_head", False),
    ([[0], [1], [0, 0], [1, 0]], "hidden_and_next_token", "shared_lm_head", False),
    ([[0], [1], [0, 0], [1, 0]], "hidden_and_path", "shared_lm_head", False),
    (DynamicTree(nodes=8, lookup=0, **FULL_LEVEL), "hidden_and_path", "shared_lm_head", False),
    (DynamicTree(nodes=8, lookup=3, **FULL_LEVEL), "hidden_and_path", "shared_lm_head", False),
    (DynamicTree(nodes=8, lookup=3, **FULL_LEVEL), "hidden_and_path", "shared_lm_head", True),
    (DynamicTree(nodes=8, lookup=3, **FULL_LEVEL), "hidden", "shared_lm_head", True),
]


@pytest.mark.parametrize("tree,head_input,layout,sure_lookup", REPEATING_TREES,
                         ids=[f"{tree}-{head_input}-{layout}{'-sure_lookup' if sure else ''}"
                              for tree, head_input, layout, sure in REPEATING_TREES])
def test_sampling_stays_lossless_where_the_tree_proposes_a_token_twice(monkeypatch, tree, head_input, layout,
                                                                      sure_lookup):
    """Where two siblings carried one token, each would get its own draw below it and the walk would keep
    whichever continued: the token after it would lean towards the tree's proposals. Heads on this model
    propose the same tokens at every step and a sure lookup chain repeats the likeliest token, so such a
    repeat, if the tree let one through, would be drawn in a third of all steps."""
    if sure_lookup:
        monkeypatch.setattr(ContextLookup, "guess", always_the_likeliest_token)
    model = unigram_model()
    decoder = MedusaDecoder(model, random_heads(model, num_heads=2, std=0.2, layout=layout, head_input=head_input))
    sampling, stats, sequences = Sampling(temperature=1.0), DecodeStats(), []
    for seed in range(300):
        request = DecodeRequest([1, 2, 3], 24, (), sampling, seed=seed)
        sequences.append([t for step in decoder.decode(request, tree, Acceptance("sample"), stats) for t in step])
    assert stats.tokens_per_step > 1.2  # the proposals are accepted, repeated ones included
    stat, critical = pair_chi_square(sequences)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: sampling through this tree is not lossless"


def typical_accept_lengths(threshold: float, alpha: float) -> Counter:
    model = tiny_vocab_model()
    decoder = MedusaDecoder(model, random_heads(model, num_heads=3, std=0.5))
    stats = DecodeStats()
    request = DecodeRequest(PROMPT, 40, (), Sampling(temperature=0.9), seed=0)
    out = [t for step in decoder.decode(request, load_tree("chain_3"), Acceptance("typical", threshold, alpha), stats)
           for t in step]
    assert len(out) == 40 and all(0 <= t < VOCAB for t in out)
    return stats.accept_lengths


def test_typical_acceptance_accepts_exactly_the_candidates_above_its_threshold():
    # Threshold min(posterior_threshold, alpha * exp(-entropy)): 1.0 is above every probability, 0 below all.
    assert set(typical_accept_lengths(threshold=1.0, alpha=1e9)) == {1}
    every = typical_accept_lengths(threshold=0.0, alpha=0.0)
    assert set(every) <= {4, 3} and every[4] >= 9  # the whole 3-node chain each step (3: the last, cut short)


def test_greedy_acceptance_refuses_a_temperature_above_zero():
    model = tiny_vocab_model()
    decoder = MedusaDecoder(model, random_heads(model, num_heads=2))
    request = DecodeRequest(PROMPT, 4, (), Sampling(temperature=0.8), seed=0)
    with pytest.raises(ValueError, match="greedy acceptance needs temperature 0"):
        next(decoder.decode(request, load_tree("chain_2"), Acceptance("greedy")))
