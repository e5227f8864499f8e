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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from inference.context_lookup import ContextLookup
from inference.cpu_linear import use_packed_bf16_linears
from inference.decoding import DecodeRequest, DecodeStats, StepEmitter, check_request
from inference.dynamic_tree import Draft, draft_dynamic_tree
from inference.kv_cache import KVBuffer
from inference.npu_attention import NPU_ATTENTION
from inference.sampling import Sampling, choose_tokens, probabilities
from inference.tree_buffers import TreeBuffers, TreeMask, build_tree_buffers
from medusa_choices import DynamicTree, Tree, TreeError

ACCEPTANCE_RULES = ("greedy", "sample", "typical")


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


class MedusaDecoder:
    """Verifies Medusa proposals for one base model + heads; tree buffers are built once per (tree, device)."""

    def __init__(self, base_model: PreTrainedModel, heads: nn.Module):
        self.base_model = base_model
        self.heads = use_packed_bf16_linears(heads)
        self._buffers: dict[tuple, TreeBuffers] = {}
        self._proposal_lm_heads: dict[tuple, nn.Module] = {}
        self._embeddings = base_model.get_input_embeddings()

    def tree_buffers(self, tree: Tree) -> TreeBuffers:
        key = (tuple(map(tuple, tree)), str(self.base_model.device))
        if key not in self._buffers:
            buffers = build_tree_buffers(tree, self.base_model.device)
            if buffers.depth > self.heads.num_heads:
                raise TreeError(f"the tree is {buffers.depth} levels deep but there are {self.heads.num_heads} heads")
            self.heads.check_top_k(buffers.topk)
            self._buffers[key] = buffers
        return self._buffers[key]

    def proposal_lm_head(self) -> nn.Module:
        """The heads' projection on the model's current device and dtype (cut to their draft vocabulary)."""
        weight = self.base_model.lm_head.weight
        key = (str(weight.device), weight.dtype)
        if key not in self._proposal_lm_heads:  # only the current device's copy is kept
            self._proposal_lm_heads = {key: use_packed_bf16_linears(self.heads.proposal_lm_head(self.base_model.lm_head))}
        return self._proposal_lm_heads[key]

    def _tree_tokens(self, root: torch.Tensor, head_logits: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """Tree tokens [T] from the root token and the heads' logits [depth, V'] at the accepted position."""
        topk = self.heads.token_ids(head_logits.topk(buffers.topk, dim=-1).indices)  # [depth, topk]
        return torch.cat([root.view(1), topk.flatten()])[buffers.tree_indices]

    def _draft(self, hidden: torch.Tensor, root: torch.Tensor, buffers: TreeBuffers, lm_head: nn.Module) -> torch.Tensor:
        """Tree tokens [T] proposed at one position (hidden [1, H]) whose next token is `root` [1]."""
        if self.heads.sequential:
            return self._draft_level_by_level(hidden, root, buffers, lm_head)
        embeds = self.heads.token_embeds(self._embeddings, root.view(1, 1))
        head_logits = self.heads(hidden, lm_head, num_heads=buffers.depth, token_embeds=embeds)[:, 0]
        return self._tree_tokens(root, head_logits, buffers)

    def _draft_level_by_level(self, hidden: torch.Tensor, root: torch.Tensor, buffers: TreeBuffers,
                              lm_head: nn.Module) -> torch.Tensor:
        """Sequentially dependent heads: head d-1 reads, for every node of level d-1 with children, the tokens
        on its path (root first) and proposes that node's children. Nodes are numbered level by level, so
        appending each level's tokens builds the tree in node order."""
        tokens = root.view(1)
        for head, level in enumerate(buffers.levels):
            path_embeds = self._embeddings(tokens[level.parent_paths])  # [parents, head+1, H]
            state = self.heads.head_state(head, hidden.expand(len(level.parent_paths), -1), path_embeds)
            logits = self.heads.project(state, lm_head)  # [parents, V']
            candidates = self.heads.token_ids(logits.topk(level.topk, dim=-1).indices)  # [parents, topk]
            tokens = torch.cat([tokens, candidates.flatten()[level.select]])
        return tokens

    def _verify_logits(self, node_hidden: torch.Tensor, depth: int,
                       with_heads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(base logits [T, V], heads' logits [depth, T, V] or None).

        Plain shared-lm_head heads run on every tree node and their states go through the SAME lm_head
        call as the verification rows: one pass over the vocabulary matrix per step instead of two (it is
        memory-bound, so the extra rows are nearly free). Other heads, and dynamic trees, run after acceptance.
        """
        lm_head = self.base_model.lm_head
        if not with_heads:
            return lm_head(node_hidden), None
        size = node_hidden.shape[0]
        states = self.heads.states(node_hidden, depth).reshape(depth * size, -1).to(node_hidden.dtype)
        logits = lm_head(torch.cat([node_hidden, states]))
        return logits[:size], logits[size:].view(depth, size, -1)

    def drafter(self, tree: Tree | DynamicTree) -> tuple[int, int, torch.Tensor, bool, Callable[..., Draft]]:
        """(tokens per step, depth, the first step's tree mask, whether the heads run in the verification pass,
        draft(root [1], hidden [1, H] of the position whose next token is root, or that position's head logits
        [depth, V] when the heads ran in the verification pass, guess = a ContextLookup guess for dynamic
        trees with lookup) -> Draft)."""
        proposal_lm_head = self.proposal_lm_head()
        if isinstance(tree, DynamicTree):
            tree.checked(self.heads.num_heads)
            self.heads.check_top_k(tree.top_k)
            depth = tree.depth(self.heads.num_heads)

            def draft_dynamic(root, hidden=None, head_logits=None, guess=([], [])):
                return draft_dynamic_tree(self.heads, self._embeddings, proposal_lm_head, hidden, root, tree, depth,
                                          guess)

            eye = torch.eye(tree.nodes + 1, dtype=torch.bool, device=self.base_model.device)
            return tree.nodes + 1, depth, eye, False, draft_dynamic
        buffers = self.tree_buffers(tree)

        def draft_static(root, hidden=None, head_logits=None, guess=([], [])):
            if head_logits is None:
                tokens = self._draft(hidden, root, buffers, proposal_lm_head)
            else:
                tokens = self._tree_tokens(root, head_logits, buffers)
            return Draft(tokens, buffers.position_offsets, buffers.retrieve_indices, None)

        in_verification = not self.heads.propose_after_verification
        return buffers.size, buffers.depth, buffers.tree_mask, in_verification, draft_static

    @torch.inference_mode()
    def decode(
        self, request: DecodeRequest, tree: Tree | DynamicTree, acceptance: Acceptance = Acceptance(),
        stats: DecodeStats | None = None,
    ) -> Iterator[list[int]]:
        """Yield each step's accepted tokens (1 to depth+1 of them) until EOS or max_new_tokens."""
        stats = stats if stats is not None else DecodeStats()
        model, lm_head = self.base_model, self.base_model.lm_head
        check_request(request, getattr(model.config, "max_position_embeddings", None))
        size, depth, tree_mask, heads_in_verification, draft = self.drafter(tree)
        device, dtype = model.device, model.dtype
        # room for the last step's tree and for the KV keep's fixed depth + 1 entries (a lookup chain may be deeper)
        capacity = len(request.input_ids) + request.max_new_tokens + max(size, depth + 1)
        cache = KVBuffer(model.config, capacity, device, dtype)
        mask = TreeMask(tree_mask, capacity, dtype, additive=model.config._attn_implementation != NPU_ATTENTION)
        generator = request.generator(device)
        sampling = request.sampling
        emitter = StepEmitter(request, stats)
        pad = torch.full((1,), -1, dtype=torch.long, device=device)
        lookup = tree.lookup if isinstance(tree, DynamicTree) else 0
        context = ContextLookup(request.input_ids) if lookup else None

        def guess(tokens: list[int]) -> tuple[list[int], list[float]]:
            """The context-lookup guess after the text so far, which now ends with `tokens`."""
            if context is None:
                return [], []
            context.extend(tokens)
            return context.guess(lookup)

        # Prefill: lm_head and heads only on the last position.
        prompt = torch.tensor([request.input_ids], device=device)
        hidden = model.model(input_ids=prompt, cache=cache, use_cache=True).last_hidden_state[:, -1]
        root = choose_tokens(lm_head(hidden), sampling, generator)
        tokens = emitter.emit(root.tolist())
        yield tokens
        if emitter.done:
            return
        step = draft(root, hidden, guess=guess(tokens))

        while True:
            start = cache.length
            if step.tree_mask is not None:
                mask.set_tree(step.tree_mask)
            out = model.model(
                input_ids=step.tokens.unsqueeze(0),
                cache=cache,
                use_cache=True,
                position_ids=step.position_offsets + start,
                attention_mask=mask.for_length(start),
            )
            node_hidden = out.last_hidden_state[0]  # [T, H]
            node_logits, all_head_logits = self._verify_logits(node_hidden, depth, heads_in_verification)
            predictions = torch.cat([choose_tokens(node_logits, sampling, generator), pad])  # [T+1], -1 = padding
            candidates = torch.cat([step.tokens, pad])[step.paths]  # [P, depth+1]
            accepted = _accept_lengths(candidates, node_logits, predictions, step.paths, sampling, acceptance)
            # Everything below indexes with device tensors or with host ints from the one transfer, and
            # every shape is fixed by the tree: no hidden synchronisation, nothing that depends on `count`.
            best = accepted.argmax(dim=0, keepdim=True)  # [1]
            count = accepted.index_select(0, best)  # [1]
            path = step.paths.index_select(0, best)[0]  # [depth+1], -1 padded
            # The one device-to-host transfer: accepted length, the path's candidates, the path's predictions.
            packed = torch.cat([count, candidates.index_select(0, best)[0, 1:], predictions[path]]).tolist()
            accepted_count = packed[0]
            tokens = emitter.emit(packed[1 : 1 + accepted_count] + [packed[1 + depth + accepted_count]])
            yield tokens
            if emitter.done:
                return
            cache.keep(start, path.clamp(min=0), accepted_count + 1)
            node = path.gather(0, count)  # [1] the last accepted node, whose prediction is the next root
            root = predictions.index_select(0, node)
            if all_head_logits is None:
                step = draft(root, node_hidden.index_select(0, node), guess=guess(tokens))
            else:
                step = draft(root, head_logits=all_head_logits.index_select(1, node)[:, 0])
