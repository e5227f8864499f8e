"""Dynamic trees: each step verifies the most likely of the heads' candidates, as a prefix-closed tree."""

import math

import pytest
import torch

from inference.engine.dynamic_tree import draft_dynamic_tree, expected_tokens, lookup_chain
from inference.engine.medusa_decoding import MedusaDecoder
from medusa_choices import DEFAULT_LOOKUP, DynamicTree, TreeError, load_tree
from medusa_helpers import random_heads, upper_half_vocab


def reference_candidates(heads, embeddings, lm_head, hidden, root: int, tree: DynamicTree, depth: int) -> dict:
    """{token path (root first): log-probability of the path} of every candidate the heads score, node by node:
    at each level the `expand` most likely nodes of the level above get their `top_k` most likely children."""
    scores, frontier = {}, [((root,), 0.0)]
    for level in range(depth):
        children = []
        for path, score in frontier:
            read = embeddings(torch.tensor([list(path)]))
            log_probs = heads.project(heads.head_state(level, hidden, read), lm_head)[0].float().log_softmax(-1)
            top = log_probs.topk(tree.top_k)
            for value, index in zip(top.values.tolist(), heads.token_ids(top.indices).tolist()):
                children.append((path + (index,), score + value))
        scores |= dict(children)
        frontier = sorted(children, key=lambda c: -c[1])[: tree.expand]
    return scores


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_dynamic_tree_verifies_the_most_likely_candidates_as_a_prefix_closed_tree(tiny_pangu, draft_vocab):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=3, std=0.3, head_input="hidden_and_path",
                         draft_vocab=upper_half_vocab(model) if draft_vocab else None)
    decoder = MedusaDecoder(model, heads)
    tree = DynamicTree(nodes=12, top_k=4, expand=3)
    embeddings, lm_head = model.get_input_embeddings(), decoder.proposal_lm_head()
    for seed in range(4):
        hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            draft = draft_dynamic_tree(heads, embeddings, lm_head, hidden, torch.tensor([5]), tree, depth=3)
            scores = reference_candidates(heads, embeddings, lm_head, hidden, 5, tree, depth=3)
        tokens, paths, mask = draft.tokens.tolist(), draft.paths.tolist(), draft.tree_mask
        node_paths = [tuple(tokens[n] for n in path if n >= 0) for path in paths]
        assert len(tokens) == 13 and node_paths[0] == (5,)
        assert set(node_paths[1:]) == set(sorted(scores, key=lambda p: -scores[p])[:12])
        assert all(p[:-1] in node_paths for p in node_paths[1:])  # every node's parent is in the tree
        assert draft.position_offsets[0].tolist() == [len(p) - 1 for p in node_paths]
        for node, path in enumerate(paths):
            assert mask[node].nonzero().flatten().tolist() == sorted(n for n in path if n >= 0)
        depths = {len(p) for p in node_paths}
        assert seed > 0 or depths == {1, 2, 3, 4}  # random heads spread their probability: some nodes are deep


def test_dynamic_tree_names_and_limits():
    assert load_tree("dynamic") == DynamicTree(16) and len(load_tree("dynamic:24")) == 24
    assert str(load_tree("dynamic:8")) == "dynamic:8" and load_tree("dynamic:8").lookup == min(DEFAULT_LOOKUP, 8)
    assert load_tree("dynamic:16").lookup == DEFAULT_LOOKUP
    assert load_tree("dynamic:8:lookup=0") == DynamicTree(8, lookup=0) and load_tree("dynamic:lookup=3").lookup == 3
    assert str(load_tree("dynamic:8:lookup=0")) == "dynamic:8:lookup=0"
    for name in ("dynamic:many", "dynamic:8:lookup", "dynamic:8:lookup=-1", "dynamic:8:4"):
        with pytest.raises(TreeError, match=r"dynamic\[:N\]\[:lookup=K\]"):
            load_tree(name)
    with pytest.raises(TreeError, match="nodes >= 1"):
        load_tree("dynamic:0")
    with pytest.raises(TreeError, match="than the heads score over 1 level "):
        load_tree("dynamic:9", num_heads=1)  # one head scores top_k = 8 candidates
    assert load_tree("dynamic:8", num_heads=1).nodes == 8
    with pytest.raises(TreeError, match="does not fit in 16 nodes"):
        load_tree("dynamic:16:lookup=999")  # a chain longer than the tree would only cost
    assert DynamicTree(4).lookup == 4 and str(DynamicTree(4)) == "dynamic:4"  # the default, capped
    with pytest.raises(TreeError, match="integers"):
        DynamicTree(True)


def test_levels_cap_the_drafted_levels_and_so_the_depth_and_candidates():
    capped = load_tree("dynamic:12:lookup=0:levels=2")
    assert capped == DynamicTree(12, lookup=0, levels=2) and str(capped) == "dynamic:12:lookup=0:levels=2"
    assert capped.head_levels(5) == 2 and capped.head_levels(1) == 1 and DynamicTree(12).head_levels(5) == 5
    assert capped.depth(5) == 2 and DynamicTree(12, levels=2).depth(5) == 12  # the lookup chain reaches deeper
    assert not DynamicTree(41, levels=2).fits(5) and DynamicTree(40, levels=2).fits(5)  # 8 + 4 * 8 candidates
    with pytest.raises(TreeError, match="than the heads score over 2 levels"):
        load_tree("dynamic:41:levels=2", num_heads=5)
    with pytest.raises(TreeError, match="levels >= 1"):
        load_tree("dynamic:12:levels=0")


def test_a_dynamic_tree_with_levels_drafts_that_many_levels_of_the_heads(tiny_pangu):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=3, std=0.3, head_input="hidden_and_path")
    decoder = MedusaDecoder(model, heads)
    tree = DynamicTree(nodes=12, top_k=4, expand=3, lookup=0, levels=2)
    embeddings, lm_head = model.get_input_embeddings(), decoder.proposal_lm_head()
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        draft = draft_dynamic_tree(heads, embeddings, lm_head, hidden, torch.tensor([5]), tree, tree.depth(3))
        scores = reference_candidates(heads, embeddings, lm_head, hidden, 5, tree, depth=2)
    assert set(token_paths(draft)[1:]) == set(sorted(scores, key=lambda p: -scores[p])[:12])
    assert draft.paths.shape[1] == 3 and max(draft.position_offsets[0].tolist()) == 2


def token_paths(draft) -> list[tuple[int, ...]]:
    tokens = draft.tokens.tolist()
    return [tuple(tokens[n] for n in path if n >= 0) for path in draft.paths.tolist()]


@pytest.mark.parametrize("std", [0.3, 3.0])  # 3.0: heads that give their top token probability 1.0 in float32
def test_drafted_trees_are_prefix_closed_and_no_two_siblings_share_a_token(tiny_pangu, std):
    """Lookup chains that repeat the heads' own proposals at every depth join them instead of doubling them,
    and a child never ties its parent, however deep and however certain the heads are."""
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=3, std=std, head_input="hidden_and_path")
    embeddings, lm_head = model.get_input_embeddings(), MedusaDecoder(model, heads).proposal_lm_head()
    generator = torch.Generator().manual_seed(0)
    for seed in range(40):
        hidden = torch.randn(1, model.config.hidden_size, generator=generator)
        with torch.no_grad():
            heads_only = draft_dynamic_tree(heads, embeddings, lm_head, hidden, torch.tensor([5]),
                                            DynamicTree(12, top_k=4, expand=3, lookup=0), depth=3)
            # the chain starts with a path of the heads' own nodes, so its first tokens repeat theirs
            proposed = token_paths(heads_only)[int(torch.randint(1, 13, (1,), generator=generator))][1:]
            chain = list(proposed) + torch.randint(0, 50, (5 - len(proposed),), generator=generator).tolist()
            sure = seed % 2 == 0
            guess = (chain, [(-1e-3 if sure else -2.0) * (k + 1) for k in range(5)])
            draft = draft_dynamic_tree(heads, embeddings, lm_head, hidden, torch.tensor([5]),
                                       DynamicTree(12, top_k=4, expand=3, lookup=5), depth=5,
                                       chain=lookup_chain(guess, 5, hidden.device))
        paths, node_paths = draft.paths.tolist(), token_paths(draft)
        for node, path in enumerate(paths):
            depth = draft.position_offsets[0, node].item()
            assert path[: depth + 1] == [n for n in path if n >= 0] and path[depth] == node  # parent, then itself
        assert len(set(node_paths)) == len(node_paths)  # siblings differ, so no two nodes have one token path
        if sure:
            assert all((5, *chain[: k + 1]) in node_paths for k in range(5))


def test_a_step_is_expected_to_emit_one_token_plus_its_likeliest_candidates_probabilities():
    assert expected_tokens([0.9, 0.5, 0.1], [math.log(0.8), math.log(0.6)], 3) == pytest.approx(1 + 0.9 + 0.8 + 0.6)
    assert expected_tokens([0.9, 0.5, 0.1], [], 2) == pytest.approx(2.4)
