"""Drafting with the feature drafter (inference/runtime/feature_drafter.py), on the device, EAGLE-2 style.

The drafter keeps a KV cache of its own for the text: position p holds what it read there, the base model's
feature of p and token p+1. After each verification it reads the accepted positions (one fixed-width call,
the entries past the accepted count are overwritten later and never visible), after a plain step the one
position written, after the prompt all of them. Its output at the last position is the predicted feature of
the next, whose lm_head projection scores the root's children. Then, level by level, it reads the `expand`
likeliest nodes of the level (their tokens and the features predicted for them) in one batched call, each
seeing the text and its own ancestors in a scratch region after the text slots, and scores their children.
The candidates and their scores are those of the Medusa heads' dynamic tree (`Candidates`), so the lookup
chain joins them and the best nodes are chosen as for the heads. Every shape is fixed by the tree's
parameters: no device-to-host read.
"""

from dataclasses import dataclass

import torch
from torch import nn

from inference.engine.draft import Carry, Draft, Verified
from inference.engine.dynamic_tree import Candidates, score_levels, select_nodes
from inference.engine.forward import BaseStates, capacity_bucket, masked_attention, prompt_attention, visible_mask
from inference.engine.graph_mode import keep_addresses
from medusa_choices import DynamicTree


@dataclass(frozen=True, eq=False)
class FeatureCache:
    """The drafter's keys and values [layers, kv_heads, capacity + scratch, head_dim] (text slots, then the draft's),
    RoPE tables for every position a draft reaches, and `state` [1, H]: its output at the last text position
    it read where a plain step or the prompt left it (a tree step carries its candidates instead)."""

    keys: torch.Tensor
    values: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    state: torch.Tensor
    capacity: int

    @property
    def slots(self) -> int:
        return self.keys.shape[2]


class FeatureCacheSlot:
    """The drafter's cache for the latest capacity, kept between requests like the base model's."""

    def __init__(self, base_model: nn.Module, drafter: nn.Module):
        self.base_model, self.drafter, self.cache = base_model, drafter, None

    def get(self, tokens: int, scratch: int) -> FeatureCache:
        capacity = capacity_bucket(tokens)
        if self.cache is None or self.cache.capacity != capacity or self.cache.slots - capacity < scratch:
            self.cache = None
            self.cache = self._new(capacity, scratch)
        return self.cache

    def _new(self, capacity: int, scratch: int) -> FeatureCache:
        fields, weight = self.drafter.fields, self.base_model.lm_head.weight
        shape = (len(self.drafter.layers), fields["num_key_value_heads"], capacity + scratch, fields["head_dim"])
        keys, values = (torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in range(2))
        positions = torch.arange(capacity + scratch, device=weight.device).unsqueeze(0)
        cos, sin = self.base_model.model.rotary_emb(keys, positions)
        state = torch.zeros((1, weight.shape[1]), device=weight.device, dtype=weight.dtype)
        keep_addresses(keys, values, state)
        return FeatureCache(keys, values, cos[0], sin[0], state, capacity)


def read_positions(drafter: nn.Module, embeddings: nn.Module, cache: FeatureCache, tokens: torch.Tensor,
                   features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   visible: torch.Tensor | None, attention=masked_attention) -> torch.Tensor:
    """The drafter's outputs [T, H] (predicted features of positions+1) for `tokens` [T] (token p+1) with
    `features` [T, H] (of position p) at `positions` [T], their keys and values written to `slots` [T].
    `visible` [T, slots] as in the base forward; None: the prompt on an empty cache, causal."""
    size = tokens.shape[0]

    def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        keys, values = cache.keys[layer], cache.values[layer]
        keys[:, slots], values[:, slots] = key, value
        scale = query.shape[-1] ** -0.5
        if visible is None:
            return prompt_attention(query, keys[:, :size], values[:, :size], scale)
        return attention(query, keys, values, visible, scale)

    return drafter(embeddings(tokens), features, cache.cos[positions], cache.sin[positions], attend)


def expanded_widths(tree: DynamicTree, depth: int) -> list[int]:
    """How many nodes the drafter reads at each level below the root's children (levels 1 .. depth-1)."""
    widths, scored = [], tree.top_k
    for _ in range(depth - 1):
        widths.append(min(tree.expand, scored))
        scored = widths[-1] * tree.top_k
    return widths


@dataclass(frozen=True, eq=False)
class FeatureTreeDrafter:
    """Drafts a dynamic tree at every step with the feature drafter (the `DynamicTreeDrafter` of this design)."""

    drafter: nn.Module
    embeddings: nn.Module
    lm_head: nn.Module  # the proposals' projection (cut to the draft vocabulary)
    tree: DynamicTree
    depth: int
    caches: FeatureCacheSlot
    attention: object = masked_attention
    propose_after_verification = True

    @property
    def tokens_per_step(self) -> int:
        return self.tree.nodes + 1

    @property
    def levels(self) -> int:
        return self.tree.head_levels(self.drafter.num_heads)

    @property
    def carry_kind(self) -> tuple:
        return ("feature candidates", self.tree.top_k, self.tree.expand, self.levels)

    @property
    def scratch(self) -> int:
        """Draft slots after the text's: one per node read below the root's children."""
        return sum(expanded_widths(self.tree, self.levels))

    @property
    def cache(self) -> FeatureCache:
        return self.caches.cache

    def start(self, tokens: int, scratch: int, prompt_states: BaseStates, prompt: list[int],
              root: torch.Tensor) -> None:
        """A request's prompt (its base states [n, ...] and ids) and first root [1] read into a cache for `tokens`
        tokens with `scratch` draft slots (the most any of the request's trees needs)."""
        cache = self.caches.get(tokens, scratch)
        ids = torch.cat([torch.tensor(prompt[1:], device=root.device, dtype=root.dtype), root])
        positions = torch.arange(len(prompt), device=root.device)
        out = read_positions(self.drafter, self.embeddings, cache, ids, self.drafter.text_features(*prompt_states),
                             positions, positions, None)
        cache.state.copy_(out[-1:])

    def after_plain_step(self, states: BaseStates, token: torch.Tensor, length: torch.Tensor) -> None:
        """A plain step wrote position `length` [1] (base states [1, ...]) and chose `token` [1] after it."""
        cache = self.cache
        one = torch.ones((1, 1), dtype=torch.bool, device=token.device)
        out = read_positions(self.drafter, self.embeddings, cache, token, self.drafter.text_features(*states), length,
                             length, visible_mask(one, length, cache.slots), self.attention)
        cache.state.copy_(out)

    def carried(self, carry: Carry) -> Candidates:
        """Candidates from where a plain step or the prompt left the drafter."""
        return self.score(self.cache.state, carry.length)

    def carry_after(self, carry: Carry, verified: Verified) -> tuple[Candidates, torch.Tensor]:
        """Read the accepted positions, then score the next step's candidates (and send their probabilities,
        highest first, in this step's transfer, as the heads' dynamic tree does)."""
        cache, path, count, start = self.cache, verified.path, verified.count, verified.start
        width = path.shape[0]
        nodes = path.clamp(min=0)
        following = torch.cat([verified.tokens.index_select(0, nodes[1:]), verified.root])  # token p+1 of each
        following = torch.where(torch.arange(width, device=start.device) == count, verified.root, following)
        causal = torch.ones((width, width), dtype=torch.bool, device=start.device).tril()
        slots = start + torch.arange(width, device=start.device)
        aux = None if verified.node_aux is None else verified.node_aux.index_select(0, nodes)
        features = self.drafter.text_features(verified.node_hidden.index_select(0, nodes), aux)
        out = read_positions(self.drafter, self.embeddings, cache, following, features, slots, slots,
                             visible_mask(causal, start, cache.slots), self.attention)
        candidates = self.score(out.index_select(0, count), start + count + 1)
        return candidates, candidates.scores.exp().sort(descending=True).values

    def draft(self, carry: Carry, chain) -> Draft:
        return select_nodes(carry.drafted, carry.root, self.tree, self.levels, self.depth, chain)

    def score(self, state: torch.Tensor, length: torch.Tensor) -> Candidates:
        """The drafter's candidates below the root at text length `length` [1] (the root's position), from its
        predicted feature `state` [1, H] there. It reads each level's expanded nodes at the position after their
        parents', their keys in the scratch slots after the text's, each seeing the text and the draft slots on
        its own path; its outputs score their children."""
        cache, device = self.cache, state.device
        text_visible = torch.arange(cache.slots, device=device) < length  # [slots]; scratch slots are >= length
        widths = expanded_widths(self.tree, self.levels)

        def log_probs(drafted: tuple, level: int) -> torch.Tensor:
            return self.drafter.project(drafted[0], self.lm_head).float().log_softmax(-1)

        def expand(drafted: tuple, level: int, parent: torch.Tensor, tokens: torch.Tensor) -> tuple:
            states, on_path = drafted  # outputs [expanded, H], draft slots on each one's path [expanded, slots]
            first = cache.capacity + sum(widths[:level])
            slots = torch.arange(first, first + parent.shape[0], device=device)
            on_path = on_path.index_select(0, parent)
            on_path[torch.arange(parent.shape[0], device=device), slots] = True
            states = read_positions(self.drafter, self.embeddings, cache, tokens, states.index_select(0, parent),
                                    (length + level).expand(parent.shape[0]), slots, text_visible | on_path,
                                    self.attention)
            return states, on_path

        start = (state, torch.zeros((1, cache.slots), dtype=torch.bool, device=device))
        return score_levels(self.tree, self.levels, start, log_probs, expand, self.drafter.token_ids, device)
