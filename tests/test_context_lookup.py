"""Context lookup: guesses from the text so far join the dynamic tree as a chain, and greedy output is unchanged."""

import math

import pytest
import torch

from inference.engine.context_lookup import FIRST_TOKEN_ACCURACY, NEXT_TOKEN_ACCURACY, ContextLookup
from inference.engine.decoding import DecodeRequest, DecodeStats
from inference.engine.dynamic_tree import draft_dynamic_tree, lookup_chain
from inference.engine.medusa_decoding import MedusaDecoder
from medusa_choices import DynamicTree
from medusa_helpers import plain_greedy, random_heads, random_prompts
from train.lookup_accuracy import lookup_accuracy


def test_guess_continues_after_the_latest_occurrence_of_the_longest_matching_suffix():
    # (2, 3) occurred twice, followed by 9 and then by 8; (5, 2, 3) never did before the end
    lookup = ContextLookup([1, 2, 3, 9, 7, 2, 3, 8, 5, 2, 3])
    tokens, scores = lookup.guess(3)
    assert tokens == [8, 5, 2]
    first, later = math.log(FIRST_TOKEN_ACCURACY[2]), math.log(NEXT_TOKEN_ACCURACY[2])
    assert scores == pytest.approx([first, first + later, first + 2 * later])
    assert ContextLookup([4, 1, 2, 3, 6, 1, 2, 3]).guess(1) == ([6], [math.log(FIRST_TOKEN_ACCURACY[3])])


def test_guess_of_a_loop_repeats_the_loop_past_the_present():
    assert ContextLookup([4, 5, 6, 4, 5, 6, 4]).guess(6)[0] == [5, 6, 4, 5, 6, 4]
    assert ContextLookup([7, 7, 7]).guess(4)[0] == [7, 7, 7, 7]


def test_no_guess_for_a_token_never_seen_before():
    assert ContextLookup([1, 2, 3, 4]).guess(5) == ([], [])
    assert ContextLookup([]).guess(5) == ([], [])


def test_extending_step_by_step_equals_indexing_at_once():
    tokens = torch.randint(0, 6, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    stepwise = ContextLookup(tokens[:10])
    for start in range(10, 60, 7):
        stepwise.extend(tokens[start : start + 7])
        at_once = ContextLookup(tokens[: start + 7])
        assert stepwise.guess(5) == at_once.guess(5)


@pytest.fixture(scope="module")
def drafting(tiny_pangu):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=3, std=0.3, head_input="hidden_and_path")
    decoder = MedusaDecoder(model, heads)
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def draft(tree: DynamicTree, guess=([], [])):
        with torch.no_grad():
            step = draft_dynamic_tree(heads, model.get_input_embeddings(), decoder.proposal_lm_head(), hidden,
                                      torch.tensor([5]), tree, tree.depth(heads.num_heads),
                                      lookup_chain(guess, tree.lookup, hidden.device) if tree.lookup else None)
        tokens = step.tokens.tolist()
        return step, {tuple(tokens[n] for n in path if n >= 0) for path in step.paths.tolist()}

    return draft


def test_a_confident_guess_is_verified_as_a_chain_below_the_root_deeper_than_the_heads(drafting):
    guess = ([11, 12, 13, 14, 15], [-1e-3 * (i + 1) for i in range(5)])  # surer than any head's proposal
    step, node_paths = drafting(DynamicTree(nodes=12, top_k=4, expand=3, lookup=5), guess)
    chain = [(5, 11, 12, 13, 14, 15)[: i + 1] for i in range(6)]
    assert set(chain) <= node_paths and len(node_paths) == 13
    deepest = next(node for node, path in enumerate(step.paths.tolist()) if path[-1] >= 0)
    assert step.position_offsets[0, deepest] == 5  # five levels below the root with three heads
    assert step.tree_mask[deepest].nonzero().flatten().tolist() == sorted(step.paths[deepest].tolist())


def test_an_unlikely_or_missing_guess_leaves_the_nodes_to_the_heads(drafting):
    _, heads_only = drafting(DynamicTree(nodes=12, top_k=4, expand=3, lookup=0))
    unlikely = ([11, 12, 13], [-50.0, -60.0, -70.0])
    _, with_unlikely = drafting(DynamicTree(nodes=12, top_k=4, expand=3, lookup=5), unlikely)
    _, with_none = drafting(DynamicTree(nodes=12, top_k=4, expand=3, lookup=5))
    assert with_unlikely == heads_only and with_none == heads_only


def test_a_guess_that_is_not_just_ahead_of_the_heads_shares_the_nodes(drafting):
    _, heads_only = drafting(DynamicTree(nodes=12, top_k=4, expand=3, lookup=0))
    _, shared = drafting(DynamicTree(nodes=12, top_k=4, expand=3, lookup=5), ([11, 12], [-1e-3, -50.0]))
    assert (5, 11) in shared and (5, 11, 12) not in shared
    assert len(shared - heads_only) == 1  # one head node made room for the one likely guess


def test_greedy_with_context_lookup_equals_plain_and_accepts_repeated_text(tiny_pangu):
    """Untrained heads accept almost nothing; the tiny model's greedy text repeats itself, which lookup finds."""
    model = tiny_pangu[1]
    decoder = MedusaDecoder(model, random_heads(model, head_input="hidden_and_path"))
    prompts = random_prompts(model.config.vocab_size, count=4)
    tokens_per_step = {}
    for lookup in (0, 8):  # a chain as long as the tree, deeper than the heads
        stats = DecodeStats()
        for prompt in prompts:
            request = DecodeRequest(prompt, 96)
            out = [t for step in decoder.decode(request, DynamicTree(nodes=8, lookup=lookup), stats=stats) for t in step]
            assert out == plain_greedy(model, prompt, 96)
        tokens_per_step[lookup] = stats.tokens_per_step
    assert tokens_per_step[0] < 1.3 and tokens_per_step[8] > 2.0


def test_lookup_accuracy_scores_each_guess_until_its_first_miss():
    # answer positions 1-3 find 1-, 2- and 3-token matches: guesses [6, 7, 5], [7, 5] and [5] against 6, 7, 9
    first, later = lookup_accuracy([{"prompt_ids": [5, 6, 7], "output_ids": [5, 6, 7, 9]}], depth=8)
    assert first == {3: (0.0, 1), 2: (1.0, 1), 1: (1.0, 1)}
    assert later == {2: (0.0, 1), 1: (0.5, 2)}
