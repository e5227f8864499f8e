"""Medusa tree decoding on the stock transformers forward of any Llama-family model.

Each step: the heads' top-k proposals are laid out as a tree, the whole tree is verified in ONE forward
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

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from inference.decoding import DecodeRequest, DecodeStats, StepEmitter, check_request
from inference.kv_cache import KVBuffer
from inference.npu_attention import NPU_ATTENTION
from inference.sampling import Sampling, choose_tokens, probabilities
from inference.tree_buffers import TreeBuffers, TreeMask, build_tree_buffers
from medusa_choices import Tree

ACCEPTANCE_RULES = ("greedy", "sample", "typical")


@dataclass(frozen=True)
class Acceptance:
    rule: str = "greedy"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self):
        if self.rule not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}")


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
        self.heads = heads
        self._buffers: dict[tuple, TreeBuffers] = {}

    def tree_buffers(self, tree: Tree) -> TreeBuffers:
        key = (tuple(map(tuple, tree)), str(self.base_model.device))
        if key not in self._buffers:
            buffers = build_tree_buffers(tree, self.base_model.device)
            if buffers.depth > self.heads.num_heads:
                raise ValueError(f"the tree is {buffers.depth} levels deep but there are {self.heads.num_heads} heads")
            self._buffers[key] = buffers
        return self._buffers[key]

    def _propose(self, hidden: torch.Tensor, root: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """Tree tokens [T] from the root token and the heads' top-k on one hidden state [1, H]."""
        head_logits = self.heads(hidden, self.base_model.lm_head, num_heads=buffers.depth)  # [depth, 1, V]
        topk = head_logits[:, 0].topk(buffers.topk, dim=-1).indices  # [depth, topk]
        return torch.cat([root.view(1), topk.flatten()])[buffers.tree_indices]

    @torch.inference_mode()
    def decode(
        self, request: DecodeRequest, tree: Tree, acceptance: Acceptance = Acceptance(),
        stats: DecodeStats | None = None,
    ) -> Iterator[list[int]]:
        """Yield each step's accepted tokens (1 to depth+1 of them) until EOS or max_new_tokens."""
        stats = stats if stats is not None else DecodeStats()
        model, lm_head = self.base_model, self.base_model.lm_head
        check_request(request, getattr(model.config, "max_position_embeddings", None))
        buffers = self.tree_buffers(tree)
        device, dtype = model.device, model.dtype
        capacity = len(request.input_ids) + request.max_new_tokens + buffers.size
        cache = KVBuffer(model.config, capacity, device, dtype)
        mask = TreeMask(buffers, capacity, dtype, additive=model.config._attn_implementation != NPU_ATTENTION)
        generator = request.generator(device)
        sampling = request.sampling
        emitter = StepEmitter(request, stats)
        pad = torch.full((1,), -1, dtype=torch.long, device=device)

        # Prefill: lm_head and heads only on the last position.
        prompt = torch.tensor([request.input_ids], device=device)
        hidden = model.model(input_ids=prompt, cache=cache, use_cache=True).last_hidden_state[:, -1]
        root = choose_tokens(lm_head(hidden), sampling, generator)
        first = emitter.emit(root.tolist())
        yield first
        if emitter.done:
            return

        while True:
            tree_tokens = self._propose(hidden, root, buffers)
            start = cache.length
            out = model.model(
                input_ids=tree_tokens.unsqueeze(0),
                cache=cache,
                use_cache=True,
                position_ids=buffers.position_offsets + start,
                attention_mask=mask.for_length(start),
            )
            node_hidden = out.last_hidden_state[0]  # [T, H]
            node_logits = lm_head(node_hidden)  # [T, V]
            predictions = torch.cat([choose_tokens(node_logits, sampling, generator), pad])  # [T+1], -1 = padding
            candidates = torch.cat([tree_tokens, pad])[buffers.retrieve_indices]  # [P, depth+1]
            accepted = _accept_lengths(
                candidates, node_logits, predictions, buffers.retrieve_indices, sampling, acceptance
            )
            best = accepted.argmax()
            path = buffers.retrieve_indices[best]
            # The one device-to-host transfer: accepted length, the path's candidates, the path's predictions.
            packed = torch.cat([accepted[best].view(1), candidates[best, 1:], predictions[path]]).tolist()
            count = packed[0]
            depth = buffers.depth
            bonus = packed[1 + depth + count]
            tokens = emitter.emit(packed[1 : 1 + count] + [bonus])
            yield tokens
            if emitter.done:
                return
            cache.keep(start, path[: count + 1])
            hidden = node_hidden[path[count]].unsqueeze(0)
            root = predictions[path[count]]
