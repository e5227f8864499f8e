"""Medusa tree decoding on the stock transformers forward of any Llama-family model.

Each step: the heads' top-k proposals are laid out as a tree (sequentially dependent heads draft it level
by level, each node from the tokens on its path), the whole tree is verified in ONE forward
with a 4D tree mask and explicit positions, the longest candidate prefix that agrees with the base
model is accepted (plus the base model's own next token), and the KV cache keeps that path in place.
All of it stays on the device except one small transfer per step (accepted length and tokens).

Acceptance rules:
- greedy: a candidate is accepted iff it equals the base model's argmax; output == plain greedy.
- sample: every tree node draws one token from the base model's (temperature/top-p) distribution at
  that node and the walk follows children that equal the draw. Each draw depends only on its own
  context, so the output is distributed exactly as plain sampling (lossless).
- typical: Medusa's typical acceptance (posterior_threshold, posterior_alpha); faster, lossy.
"""

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from inference.engine.context_lookup import ContextLookup
from inference.engine.cpu_linear import use_packed_bf16_linears
from inference.engine.decoding import DecodeRequest, DecodeStats, StepEmitter, check_request
from inference.engine.draft import Carry, Draft, Verified
from inference.engine.dynamic_tree import (Candidates, draft_dynamic_tree, expected_tokens, lookup_chain, score_candidates,
                                          select_nodes)
from inference.engine.feature_drafting import FeatureCacheSlot, FeatureTreeDrafter
from inference.engine.forward import (CacheSlot, StaticCache, cache_dtype, check_supported, forward, prefill,
                                      visible_mask)
from inference.engine.graph_mode import CapturedStep
from inference.engine.npu_attention import attention_for
from inference.engine.phases import ACCEPTANCE, CAPTURED, DRAFTING, FORWARD, HOST, NO_CLOCK
from inference.engine.plain_decoding import next_token
from inference.engine.sampling import Sampling, choose_tokens, exponential_race, probabilities
from inference.engine.step_schedule import AdaptiveSchedule, FixedSchedule
from inference.engine.tree_buffers import TreeBuffers, build_tree_buffers
from medusa_choices import DynamicTree, Tree, TreeError

ACCEPTANCE_RULES = ("greedy", "sample", "typical")

Chain = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a context-lookup guess laid out by `lookup_chain`


NOTHING_CARRIED = "nothing"  # the `carry_kind` of a carry whose `drafted` is a placeholder


@dataclass(frozen=True)
class Acceptance:
    rule: str = "greedy"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self):
        if self.rule not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}")
        for name in ("posterior_threshold", "posterior_alpha"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {getattr(self, name)}")


def default_rule(temperature: float) -> str:
    """Exact greedy acceptance at temperature 0, lossless sampling otherwise."""
    return "greedy" if temperature == 0 else "sample"


def _accept_lengths(
    candidates: torch.Tensor, node_logits: torch.Tensor, predictions: torch.Tensor, paths: torch.Tensor,
    sampling: Sampling, acceptance: Acceptance,
) -> torch.Tensor:
    """Accepted candidates per path [P]: how many leading path tokens the base model agrees with."""
    if acceptance.rule == "typical" and not sampling.greedy:
        probs = probabilities(node_logits, sampling)  # [T+1, V], the extra row is padding
        entropy = -(probs * torch.log(probs + 1e-10)).sum(-1)
        threshold = torch.clamp(acceptance.posterior_alpha * torch.exp(-entropy), max=acceptance.posterior_threshold)
        parents = paths[:, :-1]
        candidate_probs = probs[parents, candidates[:, 1:].clamp(min=0)]
        agree = (candidate_probs > threshold[parents]) & (candidates[:, 1:] >= 0)
    else:
        agree = candidates[:, 1:] == predictions[paths[:, :-1]]
    return agree.int().cumprod(dim=1).sum(dim=1)


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """A tensor of its own where a carried value is unused (an alias of another input would give a captured
    step a second graph, for the first step only)."""
    return torch.zeros(1, dtype=like.dtype, device=like.device)


@dataclass(frozen=True, eq=False)
class FixedTreeDrafter:
    """Drafts the same tree shape at every step, from the heads' top-k at the accepted position."""

    heads: nn.Module
    embeddings: nn.Module
    lm_head: nn.Module  # the heads' projection (cut to their draft vocabulary)
    buffers: TreeBuffers

    @property
    def tokens_per_step(self) -> int:
        return self.buffers.size

    @property
    def depth(self) -> int:
        return self.buffers.depth

    @property
    def tree_mask(self) -> torch.Tensor:
        return self.buffers.tree_mask

    @property
    def propose_after_verification(self) -> bool:
        """False for plain shared-lm_head heads: they run inside the verification's lm_head pass."""
        return self.heads.propose_after_verification

    def from_hidden(self, root: torch.Tensor, hidden: torch.Tensor, chain: Chain | None = None) -> Draft:
        """The step after the position whose hidden state is `hidden` [1, H] and whose next token is `root` [1]
        (a fixed tree has no lookup chain: `chain` is taken for the drafters' common signature, and unused)."""
        if self.heads.sequential:
            return self._draft(self._level_by_level(root, hidden))
        return self._draft(self._tree_tokens(root, self._logits_of_heads(root, hidden)))

    def _logits_of_heads(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The heads' logits [depth, V'] at the position of `hidden` [1, H], whose next token is `root` [1]."""
        embeds = self.heads.token_embeds(self.embeddings, root.view(1, 1))
        return self.heads(hidden, self.lm_head, num_heads=self.depth, token_embeds=embeds)[:, 0]

    @property
    def carry_kind(self) -> tuple | str:
        """What `drafted` holds between its steps: the heads' logits of its depth, or nothing."""
        return NOTHING_CARRIED if self.propose_after_verification else ("head logits", self.depth)

    def carried(self, carry: Carry) -> torch.Tensor:
        """What a step drafts from where the step before it carried something else (the first, or after a switch):
        the heads' logits, or a placeholder."""
        if self.propose_after_verification:
            return _placeholder(carry.hidden)
        return self._logits_of_heads(carry.root, carry.hidden)

    def carry_after(self, carry: Carry, verified: Verified) -> tuple[torch.Tensor, None]:
        """What the next step drafts from: the heads' logits at the accepted node, computed in the verification."""
        if verified.all_head_logits is None:
            return carry.drafted, None
        return verified.all_head_logits.index_select(1, verified.node)[:, 0], None

    def draft(self, carry: Carry, chain: Chain | None) -> Draft:
        if self.propose_after_verification:
            return self.from_hidden(carry.root, carry.hidden)
        return self.from_head_logits(carry.root, carry.drafted)

    def from_head_logits(self, root: torch.Tensor, head_logits: torch.Tensor) -> Draft:
        """The step from the heads' logits [depth, V'] at the accepted position, computed in the verification."""
        return self._draft(self._tree_tokens(root, head_logits))

    def _draft(self, tokens: torch.Tensor) -> Draft:
        return Draft(tokens, self.buffers.position_offsets, self.buffers.retrieve_indices, None)

    def _tree_tokens(self, root: torch.Tensor, head_logits: torch.Tensor) -> torch.Tensor:
        topk = self.heads.token_ids(head_logits.topk(self.buffers.topk, dim=-1).indices)  # [depth, topk]
        return torch.cat([root.view(1), topk.flatten()])[self.buffers.tree_indices]

    def _level_by_level(self, root: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Sequentially dependent heads: head d-1 reads, for every node of level d-1 with children, the tokens
        on its path (root first) and proposes that node's children. Nodes are numbered level by level, so
        appending each level's tokens builds the tree in node order."""
        tokens = root.view(1)
        for head, level in enumerate(self.buffers.levels):
            path_embeds = self.embeddings(tokens[level.parent_paths])  # [parents, head+1, H]
            state = self.heads.head_state(head, hidden.expand(len(level.parent_paths), -1), path_embeds)
            logits = self.heads.project(state, self.lm_head)  # [parents, V']
            candidates = self.heads.token_ids(logits.topk(level.topk, dim=-1).indices)  # [parents, topk]
            tokens = torch.cat([tokens, candidates.flatten()[level.select]])
        return tokens


@dataclass(frozen=True, eq=False)
class DynamicTreeDrafter:
    """Drafts a new tree at every step from the heads' probabilities and the context-lookup guess."""

    heads: nn.Module
    embeddings: nn.Module
    lm_head: nn.Module
    tree: DynamicTree
    depth: int
    propose_after_verification = True  # a second lm_head pass would cost more than drafting after it

    @property
    def tokens_per_step(self) -> int:
        return self.tree.nodes + 1

    @property
    def levels(self) -> int:
        return self.tree.head_levels(self.heads.num_heads)

    @property
    def carry_kind(self) -> tuple:
        """The heads' candidates, which serve a dynamic tree of any node count with the same top_k, expand and levels."""
        return ("candidates", self.tree.top_k, self.tree.expand, self.levels)

    def carried(self, carry: Carry) -> Candidates:
        return self._candidates(carry.root, carry.hidden)

    def _candidates(self, root: torch.Tensor, hidden: torch.Tensor) -> Candidates:
        return score_candidates(self.heads, self.embeddings, self.lm_head, hidden, root, self.tree)

    def from_hidden(self, root: torch.Tensor, hidden: torch.Tensor, chain: Chain | None = None) -> Draft:
        """The step after the position whose hidden state is `hidden` [1, H] and whose next token is `root` [1]."""
        return draft_dynamic_tree(self.heads, self.embeddings, self.lm_head, hidden, root, self.tree, self.depth, chain)

    def carry_after(self, carry: Carry, verified: Verified) -> tuple[Candidates, torch.Tensor]:
        """The next step's candidates, scored now, and their probabilities, highest first: the host reads them in
        this step's one transfer and chooses the next step's size from them."""
        candidates = self._candidates(verified.root, verified.hidden)
        return candidates, candidates.scores.exp().sort(descending=True).values

    def draft(self, carry: Carry, chain: Chain | None) -> Draft:
        return select_nodes(carry.drafted, carry.root, self.tree, self.levels, self.depth, chain)


Drafter = FixedTreeDrafter | DynamicTreeDrafter | FeatureTreeDrafter


def _plain_key(cache: StaticCache, sampling: Sampling, follower: FeatureTreeDrafter | None) -> tuple:
    """What a captured plain step's graph depends on."""
    return cache.capacity, sampling, follower is not None


class MedusaDecoder:
    """Verifies Medusa proposals for one base model + heads, eager or with the step captured (`compile`);
    tree buffers and drafters are built once per tree, the cache once per capacity."""

    def __init__(self, base_model: PreTrainedModel, heads: nn.Module, compile: bool = False,
                 attention: Callable | None = None, log: Callable[[str], None] | None = None):
        check_supported(base_model)
        if base_model.lm_head.weight.shape[0] > 2**24:  # a step's transfer carries ids as float32 beside probabilities
            raise ValueError("vocabularies above 2**24 tokens are not supported")
        self.base_model = base_model
        self.heads = use_packed_bf16_linears(heads)
        self.attention = attention or attention_for(base_model.device, base_model.dtype)
        self.cache = CacheSlot(base_model, cache_dtype(self.attention, base_model.dtype))
        self.step = CapturedStep(self._step, base_model.device, base_model.dtype, compile, "Medusa", log)
        self.plain_step = CapturedStep(self._plain_step, base_model.device, base_model.dtype, compile, "plain",
                                       log)
        self.step_clock = NO_CLOCK  # what the steps mark their phases on: a decode's clock when eager
        self._buffers: dict[tuple, TreeBuffers] = {}
        self._drafters: dict[tuple, Drafter] = {}
        self._proposal_lm_heads: dict[tuple, nn.Module] = {}
        self._embeddings = base_model.get_input_embeddings()
        self._feature_caches = FeatureCacheSlot(base_model, self.heads) if self._features else None
        if any(i >= base_model.config.num_hidden_layers for i in self._aux_layers):
            raise ValueError(f"the feature drafter fuses layers {list(self._aux_layers)}, but the base model has "
                             f"{base_model.config.num_hidden_layers}")

    @property
    def _aux_layers(self) -> tuple[int, ...]:
        """The base layers whose inputs a fused feature drafter reads (none for other heads)."""
        return getattr(self.heads, "aux_layers", ())

    @property
    def _features(self) -> bool:
        """Whether the heads are a feature drafter (inference/runtime/feature_drafter.py)."""
        return getattr(self.heads.config, "medusa_head_input", None) == "features"

    def tree_buffers(self, tree: Tree) -> TreeBuffers:
        key = (tuple(map(tuple, tree)), str(self.base_model.device))
        if key not in self._buffers:
            buffers = build_tree_buffers(tree, self.base_model.device)
            if buffers.depth > self.heads.num_heads:
                raise TreeError(f"the tree is {buffers.depth} levels deep but there are {self.heads.num_heads} heads")
            self._buffers[key] = buffers
        return self._buffers[key]

    def proposal_lm_head(self) -> nn.Module:
        """The heads' projection on the model's current device and dtype (cut to their draft vocabulary)."""
        weight = self.base_model.lm_head.weight
        key = (str(weight.device), weight.dtype)
        if key not in self._proposal_lm_heads:  # only the current device's copy is kept
            self._proposal_lm_heads = {key: use_packed_bf16_linears(self.heads.proposal_lm_head(self.base_model.lm_head))}
        return self._proposal_lm_heads[key]

    def _verify_logits(self, node_hidden: torch.Tensor, depth: int,
                       propose_after_verification: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(base logits [T, V], heads' logits [depth, T, V] or None).

        Plain shared-lm_head heads run on every tree node and their states go through the SAME lm_head
        call as the verification rows: one pass over the vocabulary matrix per step instead of two (it is
        memory-bound, so the extra rows are nearly free). Other heads, and dynamic trees, run after acceptance.
        """
        lm_head = self.base_model.lm_head
        if propose_after_verification:
            return lm_head(node_hidden), None
        size = node_hidden.shape[0]
        states = self.heads.states(node_hidden, depth).reshape(depth * size, -1).to(node_hidden.dtype)
        logits = lm_head(torch.cat([node_hidden, states]))
        return logits[:size], logits[size:].view(depth, size, -1)

    def drafter(self, tree: Tree | DynamicTree) -> Drafter:
        """How each step of `tree` is drafted with these heads (checked against them; one per tree and dtype,
        so a captured step sees the same drafter every time)."""
        key = (repr(tree), self.base_model.lm_head.weight.dtype)
        if key not in self._drafters:
            self.heads.check_ranks(tree)
            if self._features:
                if not isinstance(tree, DynamicTree):
                    raise TreeError("the feature drafter drafts a dynamic tree at every step (dynamic:N; "
                                    "chain:N for a chain), not a fixed tree")
                drafter = FeatureTreeDrafter(self.heads, self._embeddings, self.proposal_lm_head(),
                                             tree.checked(self.heads.num_heads), tree.depth(self.heads.num_heads),
                                             self._feature_caches, self.attention)
            elif isinstance(tree, DynamicTree):
                tree.checked(self.heads.num_heads)
                drafter = DynamicTreeDrafter(self.heads, self._embeddings, self.proposal_lm_head(), tree,
                                             tree.depth(self.heads.num_heads))
            else:
                drafter = FixedTreeDrafter(self.heads, self._embeddings, self.proposal_lm_head(),
                                           self.tree_buffers(tree))
            self._drafters[key] = drafter
        return self._drafters[key]

    def _step(self, drafter: Drafter, sampling: Sampling, acceptance: Acceptance,
              cache: StaticCache, carry: Carry, chain: Chain | None,
              race: torch.Tensor | None) -> tuple[torch.Tensor, Carry]:
        """One Medusa step, everything between two host reads: draft the tree, verify it in one forward,
        accept the longest agreeing path, keep its KV entries. Returns what the host reads (accepted count,
        the best path's candidates and predictions) and what the next step starts from.

        Every tensor is indexed with device tensors and every shape is fixed by the tree: no hidden
        synchronisation, nothing that depends on how many tokens were accepted."""
        depth, start = drafter.depth, carry.length
        step = drafter.draft(carry, chain)
        self.step_clock.mark(DRAFTING)
        tree_mask = drafter.tree_mask if step.tree_mask is None else step.tree_mask
        size = step.tokens.shape[0]
        slots = start + torch.arange(size, device=start.device)
        node_hidden, node_aux = forward(self.base_model, cache, step.tokens, start + step.position_offsets[0], slots,
                                        visible_mask(tree_mask, start, cache.capacity), self.attention,
                                        self._aux_layers)
        node_logits, all_head_logits = self._verify_logits(node_hidden, depth, drafter.propose_after_verification)
        self.step_clock.mark(FORWARD)
        pad = torch.full((1,), -1, dtype=torch.long, device=start.device)
        predictions = torch.cat([choose_tokens(node_logits, sampling, race), pad])  # [T+1], -1 = padding
        candidates = torch.cat([step.tokens, pad])[step.paths]  # [P, depth+1]
        accepted = _accept_lengths(candidates, node_logits, predictions, step.paths, sampling, acceptance)
        best = accepted.argmax(dim=0, keepdim=True)  # [1]
        count = accepted.index_select(0, best)  # [1]
        path = step.paths.index_select(0, best)[0]  # [depth+1], -1 padded
        cache.keep(start, path.clamp(min=0))
        node = path.gather(0, count)  # [1] the last accepted node, whose prediction is the next root
        root, hidden = predictions.index_select(0, node), node_hidden.index_select(0, node)
        verified = Verified(step.tokens, node_hidden, node_aux, start, path, count, node, root, hidden, all_head_logits)
        self.step_clock.mark(ACCEPTANCE)
        drafted, probabilities = drafter.carry_after(carry, verified)
        packed = torch.cat([count, candidates.index_select(0, best)[0, 1:], predictions[path]])
        if probabilities is not None:  # token ids are exact in float32 (the vocabulary is below 2**24)
            packed = torch.cat([packed.float(), probabilities])
        self.step_clock.mark(DRAFTING)  # the next step's candidates, scored after acceptance
        return packed, Carry(root, hidden, drafted, start + count + 1)

    def _plain_step(self, sampling: Sampling, cache: StaticCache, carry: Carry, race: torch.Tensor | None,
                    follower: FeatureTreeDrafter | None) -> tuple[torch.Tensor, Carry]:
        """A plain step on the Medusa cache (a schedule's fallback, exact like a tree step): the carried root is
        written and the base model's next token is the next root. A feature drafter (`follower`) reads the
        position too, so its cache never misses text."""
        token, states = next_token(self.base_model, cache, carry.root, carry.length, self.attention, sampling, race,
                                   self._aux_layers)
        hidden = states.hidden
        self.step_clock.mark(FORWARD)
        if follower is not None:
            follower.after_plain_step(states, token, carry.length)
            self.step_clock.mark(DRAFTING)
        return token, Carry(token, hidden, _placeholder(hidden), carry.length + 1)

    def _run_step(self, tree: Tree | DynamicTree | None, drafter: Drafter | None,
                  sampling: Sampling, acceptance: Acceptance, cache: StaticCache, carry: Carry, chain: Chain | None,
                  race: torch.Tensor | None, stats: DecodeStats,
                  follower: FeatureTreeDrafter | None = None) -> tuple[list[int], Carry, list[float] | None]:
        """One step of `tree` (None: a plain step): its new tokens, what the next step starts from and (dynamic
        trees) the probabilities of the next step's candidates, highest first, all read in the step's one
        device-to-host transfer."""
        if tree is None:
            token, carry = self._plain(sampling, cache, carry, race, stats, follower)
            self._captured_phase(stats)
            return token.tolist(), carry, None
        key = (cache.capacity, repr(tree), sampling, acceptance)
        kind = "dynamic " if isinstance(tree, DynamicTree) else ""
        label = f"{drafter.tokens_per_step}-token {kind}tree, capacity {cache.capacity}"
        packed, carry = self.step(key, label, stats, drafter, sampling, acceptance, cache, carry, chain, race)
        self._captured_phase(stats)
        packed = packed.tolist()
        count, depth = int(packed[0]), drafter.depth
        tokens = [int(t) for t in packed[1 : 1 + count] + [packed[1 + depth + count]]]
        return tokens, carry, packed[2 + 2 * depth :] if isinstance(tree, DynamicTree) else None

    def _plain(self, sampling: Sampling, cache: StaticCache, carry: Carry, race: torch.Tensor | None,
               stats: DecodeStats, follower: FeatureTreeDrafter | None) -> tuple[torch.Tensor, Carry]:
        """A plain step, captured or eager."""
        return self.plain_step(_plain_key(cache, sampling, follower), f"plain, capacity {cache.capacity}", stats,
                               sampling, cache, carry, race, follower)

    def _compile_plain_step(self, sampling: Sampling, cache: StaticCache, carry: Carry, stats: DecodeStats,
                            follower: FeatureTreeDrafter | None) -> None:
        """Compile a schedule's plain step with the request's first step, not when the schedule first picks one
        (a stall of up to a minute in the middle of an answer). The step runs once and what it returns is dropped:
        it writes the cache slot at `carry.length`, which the first real step writes again, the feature drafter's
        state is put back, and its noise comes from a generator of its own, so the request's draws are unchanged."""
        if not self.plain_step.captured or _plain_key(cache, sampling, follower) in self.plain_step.compiled:
            return
        device, vocab = self.base_model.device, self.base_model.lm_head.weight.shape[0]
        race = exponential_race(1, vocab, sampling, torch.Generator(device=device), device)
        state = None if follower is None else follower.cache.state.clone()
        self._plain(sampling, cache, carry, race, stats, follower)
        if state is not None:
            follower.cache.state.copy_(state)

    def _captured_phase(self, stats: DecodeStats) -> None:
        """A captured step is one graph: its phases cannot be told apart, so its time is one phase."""
        if self.step.captured and stats.phases is not None:
            stats.phases.mark(CAPTURED)

    @torch.inference_mode()
    def decode(
        self, request: DecodeRequest, tree: Tree | DynamicTree | FixedSchedule | AdaptiveSchedule,
        acceptance: Acceptance = Acceptance(), stats: DecodeStats | None = None,
    ) -> Iterator[list[int]]:
        """Yield each step's accepted tokens (1 to depth+1 of them) until EOS or max_new_tokens. `tree`: the tree of
        every step, or a schedule that picks one (or a plain step) at each step and learns from its timing."""
        stats = stats if stats is not None else DecodeStats()
        model, sampling = self.base_model, request.sampling
        check_request(request, getattr(model.config, "max_position_embeddings", None))
        if acceptance.rule == "greedy" and not sampling.greedy:
            raise ValueError("greedy acceptance needs temperature 0 (use sample or typical acceptance to sample)")
        schedule = tree if isinstance(tree, (FixedSchedule, AdaptiveSchedule)) else FixedSchedule(tree)
        options = schedule.begin()
        drafters = [None if o.tree is None else self.drafter(o.tree) for o in options]
        device, vocab = model.device, model.lm_head.weight.shape[0]
        # room for the last step's tree and for the KV keep's fixed depth + 1 entries (a lookup chain may be deeper)
        cache = self.cache.get(len(request.input_ids) + request.max_new_tokens
                               + max(max(d.tokens_per_step, d.depth + 1) for d in drafters if d is not None))
        generator = request.generator(device)
        emitter = StepEmitter(request, stats)
        lookups = [o.tree.lookup if isinstance(o.tree, DynamicTree) else 0 for o in options]
        context = ContextLookup(request.input_ids) if any(lookups) else None

        prompt_states = prefill(model, cache, request.input_ids, self._aux_layers)
        hidden = prompt_states.hidden[-1:]
        root = choose_tokens(model.lm_head(hidden), sampling, exponential_race(1, vocab, sampling, generator, device))
        # the feature drafter reads every position of the text, plain steps' too (the schedule's may all be plain)
        follower = next((d for d in drafters if isinstance(d, FeatureTreeDrafter)), None)
        if follower is not None:
            scratch = max(d.scratch for d in drafters if isinstance(d, FeatureTreeDrafter))
            follower.start(cache.capacity, scratch, prompt_states, request.input_ids, root)
        carry = Carry(root, hidden, _placeholder(hidden), torch.tensor([len(request.input_ids)], device=device))
        plain_to_compile = any(o.tree is None for o in options)
        carried = NOTHING_CARRIED  # the carry_kind of what `carry.drafted` holds
        probabilities = None  # of the next step's candidates, where the last step scored them
        clock = stats.phases or NO_CLOCK
        self.step_clock = NO_CLOCK if self.step.captured else clock
        clock.start()
        tokens = emitter.emit(root.tolist())
        while True:
            yield tokens
            if emitter.done:
                clock.mark(HOST)
                clock.stop()
                return
            started, compiling = time.perf_counter(), stats.compile_seconds
            guess = ([], [])
            if context is not None:
                context.extend(tokens)
                guess = context.guess(max(lookups))
            choosing = probabilities is not None and len(options) > 1  # (a fixed tree has nothing to size)
            index = schedule.next(stats, None if not choosing else [
                expected_tokens(probabilities, guess[1][:lookup], len(o.tree))
                if d is not None and d.carry_kind == carried else None
                for o, d, lookup in zip(options, drafters, lookups)])
            tree, drafter, lookup = options[index].tree, drafters[index], lookups[index]
            if drafter is not None and drafter.carry_kind != carried:  # the carry holds another drafter's input
                carry = carry._replace(drafted=drafter.carried(carry))
            race = exponential_race(options[index].tokens, vocab, sampling, generator, device)
            chain = lookup_chain(guess, lookup, device) if lookup else None
            clock.mark(HOST)
            if plain_to_compile:  # with the first step, which compiles its own too
                self._compile_plain_step(sampling, cache, carry, stats, follower)
                plain_to_compile = False
            new, carry, probabilities = self._run_step(tree, drafter, sampling, acceptance, cache, carry, chain, race,
                                                       stats, follower)
            carried = NOTHING_CARRIED if drafter is None else drafter.carry_kind
            if stats.compile_seconds == compiling:  # a step that compiled says nothing about what steps cost
                schedule.observe(index, 1000 * (time.perf_counter() - started), len(new))
            stats.step_sizes[options[index].tokens] += 1
            tokens = emitter.emit(new)
