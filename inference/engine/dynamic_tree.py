"""Drafting a `DynamicTree`: the step's tree chosen from the heads' probabilities, on the device.

Level d (1-based) scores `top_k` children for each of the `expand` most likely nodes of level d-1 (the root
alone at level 1) with head d-1, which reads each node's token path like any sequentially dependent head.
A node's score is the log of the product of the probabilities on its path, less a hair per level so a
child always scores below its parent, also where a head gives its token probability 1.0 (`_below`): the
`nodes` best-scoring candidates then always include their parents, so the chosen tree is prefix-closed
without a search. Every shape is fixed by the tree's parameters, so drafting adds no device-to-host read.
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from inference.engine.draft import Draft
from medusa_choices import DynamicTree

# Relative and absolute hair taken off per level, so a child scores strictly below its parent in float32
# at any depth (a fixed 1e-6 alone is below float32's resolution once a score passes -8).
_HAIR = 1e-6


def _below(parent_score, log_prob):
    """The score of a child whose token has `log_prob` (<= 0) below a parent scored `parent_score` (<= 0):
    their sum less a hair that float32 can resolve, so a child never ties its parent."""
    return (parent_score + log_prob) * (1 + _HAIR) - _HAIR


def _paths_and_mask(parent: torch.Tensor, depth_of: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-to-node paths [T, depth+1] and the ancestor mask [T, T] of a tree given by each node's parent
    (`parent[0]` = -1 for the root) and depth."""
    size = parent.shape[0]
    paths = torch.full((size, depth + 2), -1, dtype=torch.long, device=parent.device)  # last column: discarded
    node = torch.arange(size, device=parent.device)
    for _ in range(depth + 1):  # walk every node up to the root, writing each ancestor at its depth
        valid = node >= 0
        column = torch.where(valid, depth_of[node.clamp(min=0)], depth + 1)
        paths.scatter_(1, column.unsqueeze(1), node.unsqueeze(1))
        node = torch.where(valid, parent[node.clamp(min=0)], -1)
    paths = paths[:, : depth + 1]
    # node j is an ancestor of i (or i) where it is on i's path; compared, not scattered: inductor's AVX2 kernel
    # for a scatter into the mask checked the padding lanes of its last vector too ("index out of bounds")
    mask = (paths.unsqueeze(-1) == torch.arange(size, device=parent.device)).any(dim=1)
    return paths, mask


def lookup_chain(guess: tuple[list[int], list[float]], length: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The context-lookup chain as `length` candidates: tokens (-1 where the guess is shorter), scores as the
    heads' are scored (-inf there, so padding is never selected and every step's shapes stay the same) and depths.
    Built on the host and copied without blocking: a blocking host-to-device copy would wait for the device's
    queue (the heads' drafting)."""
    guessed, log_scores = guess[0][:length], guess[1][:length]
    missing = length - len(guessed)
    scores, previous = [], 0.0
    for log_score in log_scores:  # each token's own log-accuracy is the step from the chain's previous prefix
        scores.append(_below(scores[-1] if scores else 0.0, log_score - previous))
        previous = log_score
    scores += [-math.inf] * missing
    ids = torch.tensor(guessed + [-1] * missing + list(range(1, length + 1)), dtype=torch.long)
    tokens, depth_of = ids.to(device, non_blocking=True).view(2, length)
    return tokens, torch.tensor(scores).to(device, non_blocking=True), depth_of


def _merge_chain(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, head_depth: int,
                 chain_tokens: torch.Tensor, chain_scores: torch.Tensor, first_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Join the lookup chain to the heads' candidates so that no two siblings carry the same token.

    Sampled acceptance draws one token per node and follows the child equal to it: two siblings with one
    token would give that token two independent draws below it, and the output would lean towards the tree.
    So chain token k becomes the heads' candidate with its token under the same parent (the root for k = 0,
    else the candidate chain token k-1 became), scored by the likelier of the two, and the chain's own
    candidate is never selected. From the first chain token the heads did not propose there, the chain goes
    on as candidates of its own below the last joined one, where no head candidate has its token. Scores
    still fall from parent to child, so the best candidates stay prefix-closed. Returns the scores of all
    candidates, the chain's appended, and the chain's parent candidate ids (-1: the root)."""
    scores, chain_scores = scores.clone(), chain_scores.clone()
    length = chain_tokens.shape[0]
    own_parents = torch.arange(first_id - 1, first_id + length - 1, device=tokens.device)
    chain_parents = []
    joined = torch.full((), -1, dtype=torch.long, device=tokens.device)  # candidate id of the last joined token
    diverged = torch.full_like(joined, -2)  # no candidate has this parent
    for k in range(min(length, head_depth)):  # the heads propose `head_depth` levels, so no deeper token joins
        chain_parents.append(torch.where(joined == diverged, own_parents[k], joined))
        match = (parents == joined) & (tokens == chain_tokens[k])
        found = match.any()
        index = match.int().argmax().view(1)
        scores.scatter_reduce_(0, index, torch.where(found, chain_scores[k], -math.inf).view(1), "amax")
        chain_scores[k] = torch.where(found, -math.inf, chain_scores[k])
        joined = torch.where(found, index[0], diverged)
    if length > head_depth:
        chain_parents.append(torch.where(joined == diverged, own_parents[head_depth], joined))
    chain_parents = torch.cat([torch.stack(chain_parents), own_parents[head_depth + 1 :]])
    return torch.cat([scores, chain_scores]), chain_parents


class Candidates(NamedTuple):
    """Every node the heads scored for one step, before the lookup chain joins and the best are chosen: tokens,
    scores (log-probability of the path), parent candidate ids (-1: the root) and depths, [C] each. The shapes
    depend on `top_k`, `expand` and the heads only, so one scoring serves a tree of any node count."""

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor


def score_levels(tree: DynamicTree, levels: int, start, log_probs, expand, token_ids, device: torch.device) -> Candidates:
    """Candidates scored level by level: `top_k` children of each node expanded at the level above (the root
    alone at the first), then the `expand` likeliest of them are expanded for the next. The drafter is two pure
    functions of its own state (whatever it needs to score the expanded nodes, `start` at the root):
    `log_probs(state, level)` [expanded, V'] over the proposal vocabulary (`token_ids` maps its indices to
    tokens), and `expand(state, level, parent, tokens)` the state of the nodes kept, each the child `tokens` [K]
    of the expanded node `parent` [K]."""
    state, path_scores = start, torch.zeros(1, device=device)
    path_ids = torch.full((1,), -1, dtype=torch.long, device=device)  # candidate ids of the expanded (-1: the root)
    tokens, scores, parents, depths = [], [], [], []
    scored = 0
    for level in range(levels):
        top_log_probs, top_index = log_probs(state, level).topk(tree.top_k, dim=-1)  # [expanded, top_k]
        level_tokens = token_ids(top_index).flatten()
        level_scores = _below(path_scores.unsqueeze(1), top_log_probs).flatten()
        tokens.append(level_tokens)
        scores.append(level_scores)
        parents.append(path_ids.repeat_interleave(tree.top_k))
        depths.append(torch.full_like(level_tokens, level + 1))
        if level + 1 < levels:
            keep = level_scores.topk(min(tree.expand, level_scores.shape[0])).indices
            state = expand(state, level, keep // tree.top_k, level_tokens[keep])
            path_scores, path_ids = level_scores[keep], scored + keep
        scored += level_scores.shape[0]
    return Candidates(*map(torch.cat, (tokens, scores, parents, depths)))


def score_candidates(heads: nn.Module, embeddings: nn.Module, lm_head: nn.Module, hidden: torch.Tensor,
                     root: torch.Tensor, tree: DynamicTree) -> Candidates:
    """The heads' candidates below `root` [1] at the position whose hidden state is `hidden` [1, H], one level per
    head (`tree.levels` at most); each head reads the token paths (root first) of the nodes it expands."""

    def log_probs(paths: torch.Tensor, level: int) -> torch.Tensor:
        state = heads.head_state(level, hidden.expand(paths.shape[0], -1), embeddings(paths))
        return heads.project(state, lm_head).float().log_softmax(-1)

    def expand(paths: torch.Tensor, level: int, parent: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat([paths.index_select(0, parent), tokens.unsqueeze(1)], dim=1)

    return score_levels(tree, tree.head_levels(heads.num_heads), root.view(1, 1), log_probs, expand, heads.token_ids,
                        hidden.device)


def select_nodes(candidates: Candidates, root: torch.Tensor, tree: DynamicTree, head_depth: int, depth: int,
                 chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Draft:
    """The `tree.nodes` likeliest of the heads' `candidates` below `root` [1] and (with `tree.lookup`) the lookup
    `chain` as `lookup_chain` lays it out (None: no guess), `depth` levels at most, as a `Draft` of
    `tree.nodes + 1` nodes."""
    device = root.device
    tokens, scores, parents, depths = candidates
    scored = tokens.shape[0]
    if tree.lookup:
        chain_tokens, chain_scores, chain_depths = chain or lookup_chain(([], []), tree.lookup, device)
        scores, chain_parents = _merge_chain(tokens, scores, parents, head_depth, chain_tokens, chain_scores,
                                             scored)
        tokens = torch.cat([tokens, chain_tokens.clamp(min=0)])
        parents = torch.cat([parents, chain_parents])
        depths = torch.cat([depths, chain_depths])
        scored += tree.lookup
    # The best nodes, in candidate order: every parent (a level above, or the chain's previous token) has a
    # smaller candidate id than its children, so it gets a smaller node id too.
    chosen = scores.topk(tree.nodes).indices.sort().values
    node_of = torch.zeros(scored + 1, dtype=torch.long, device=device)  # candidate id + 1 -> node id (0: root)
    node_of[chosen + 1] = torch.arange(1, tree.nodes + 1, device=device)
    minus_one = torch.full((1,), -1, dtype=torch.long, device=device)
    parent = torch.cat([minus_one, node_of[parents[chosen] + 1]])
    depth_of = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths[chosen]])
    node_paths, mask = _paths_and_mask(parent, depth_of, depth)
    return Draft(torch.cat([root.view(1), tokens[chosen]]), depth_of.unsqueeze(0), node_paths, mask)


def draft_dynamic_tree(heads: nn.Module, embeddings: nn.Module, lm_head: nn.Module, hidden: torch.Tensor,
                       root: torch.Tensor, tree: DynamicTree, depth: int,
                       chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Draft:
    """The `tree.nodes` most likely continuations of `root` [1] at the position whose hidden state is
    `hidden` [1, H], drafted `depth` levels deep by the heads (one level per head) and, when `chain` holds
    context-lookup tokens (as `lookup_chain` lays them out), up to `tree.lookup` deep along that chain below
    the root, as a `Draft` of `tree.nodes + 1` nodes."""
    candidates = score_candidates(heads, embeddings, lm_head, hidden, root, tree)
    return select_nodes(candidates, root, tree, tree.head_levels(heads.num_heads), depth, chain)


def expected_tokens(head_probabilities: list[float], chain_log_scores: list[float], nodes: int) -> float:
    """Tokens a step of `nodes` nodes is expected to emit: 1 + the probabilities of the `nodes` likeliest
    candidates, the heads' (sorted, descending) and the lookup chain's together, each node being accepted with
    its path's probability. A chain token the heads also proposed counts twice, an overestimate that the
    schedule's realised acceptance corrects."""
    chain = sorted((math.exp(score) for score in chain_log_scores), reverse=True)
    merged = sorted(head_probabilities[:nodes] + chain[:nodes], reverse=True)
    return 1 + sum(merged[:nodes])
