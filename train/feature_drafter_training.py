"""Training the feature drafter (inference/runtime/feature_drafter.py) by teacher forcing on cached features.

The frozen base model runs once over every sample (prompt + distilled answer) and its final hidden states
are kept. At position p the drafter reads the base feature of p and token p+1 and is trained, over whole
sequences at once (causal attention, as it reads text at decoding time), towards the base feature of p+1
(smooth L1, EAGLE's regression) and towards the base model's distribution at p+1 over the proposal
vocabulary (soft targets, from that feature through the lm_head). With `unroll` > 1 every further pass
reads the drafter's own predicted features in place of the base model's (EAGLE-3's training-time test),
as it does below the first level of a draft; each pass's losses count equally. Losses count where the
predicted token is an answer token. A fused drafter reads, in the first pass, the final features plus its map of
the intermediate layers' inputs (kept beside them); its regression target stays the final feature.
"""

import copy
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference.engine.feature_drafting import FeatureCacheSlot, read_positions
from inference.runtime.feature_drafter import FeatureDrafter, base_hidden


@dataclass(frozen=True)
class FeatureSample:
    """One sample's ids [L] (prompt + answer), the base features [L, H] (base dtype; None: computed in each
    training step), where its answer starts, and for a fused drafter the inputs of its layers [L, A*H]."""

    ids: torch.Tensor
    features: torch.Tensor | None
    answer_start: int
    aux: torch.Tensor | None = None


def feature_samples(samples: list[dict], max_length: int) -> list[FeatureSample]:
    """Distillation records (prompt_ids, output_ids) as samples whose features the training steps compute: for a
    base model whose features would not fit in memory (a 7B model's are 8 KB per token in bf16)."""
    return [FeatureSample(torch.tensor((s["prompt_ids"] + s["output_ids"])[:max_length]), None, len(s["prompt_ids"]))
            for s in samples]


@torch.inference_mode()
def base_features(base_model: nn.Module, samples: list[dict], max_length: int, progress=None,
                  aux_layers: tuple[int, ...] = ()) -> list[FeatureSample]:
    """`FeatureSample`s of distillation records with their features (and the inputs of `aux_layers`): the base
    model run once over each."""
    out = []
    for sample in feature_samples(samples, max_length):
        hidden, aux = base_hidden(base_model, sample.ids.to(base_model.device).unsqueeze(0), aux_layers)
        out.append(FeatureSample(sample.ids, hidden[0].cpu(), sample.answer_start,
                                 None if aux is None else aux[0].cpu()))
        if progress is not None:
            progress.update()
    return out


def causal_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


class DrafterLoss(nn.Module):
    """The drafter's training loss over a batch of padded sequences, and the top-1 agreement it reached."""

    def __init__(self, drafter: FeatureDrafter, base_model: nn.Module, unroll: int = 1, token_weight: float = 0.1):
        super().__init__()
        self.drafter, self.base_model = drafter, base_model
        self.embeddings = base_model.get_input_embeddings()
        self.proposals = drafter.proposal_lm_head(base_model.lm_head)
        self.rotary = base_model.model.rotary_emb
        self.unroll, self.token_weight = unroll, token_weight

    def forward(self, ids: torch.Tensor, features: torch.Tensor, mask: torch.Tensor,
                aux: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """`ids` [B, L], base `features` [B, L, H] (float32), `mask` [B, L]: where position p's prediction (of
        token p+2) counts; `aux` [B, L, A*H]: the inputs of a fused drafter's layers."""
        weight = next(self.drafter.parameters())
        positions = torch.arange(ids.shape[1] - 1, device=ids.device).unsqueeze(0)
        cos, sin = (t[0].to(weight.dtype) for t in self.rotary(features, positions))
        embeds = self.embeddings(ids[:, 1:]).to(weight.dtype).detach()  # token p+1 at position p
        target = features[:, 1:]  # feature of p+1
        with torch.no_grad():
            teacher = self.proposals(target.to(self.proposals.weight.dtype)).float().log_softmax(-1)
        mask = mask[:, :-1].float()
        count = mask.sum().clamp(min=1)
        text = self.drafter.text_features(features, aux)[:, :-1]
        read = text
        loss, stats = 0.0, {}
        for unrolled in range(self.unroll):
            predicted = self.drafter(embeds, read.to(weight.dtype), cos, sin, causal_attention)
            regression = (F.smooth_l1_loss(predicted.float(), target, reduction="none").mean(-1) * mask).sum() / count
            log_probs = self.proposals(predicted.to(self.proposals.weight.dtype)).float().log_softmax(-1)
            soft = -((teacher.exp() * log_probs).sum(-1) * mask).sum() / count
            loss = loss + regression + self.token_weight * soft
            agree = ((log_probs.argmax(-1) == teacher.argmax(-1)).float() * mask).sum() / count
            stats[f"pass{unrolled}_top1"] = agree.item()
            # the next pass reads, at position p, the feature this one predicted for p (its output at p-1)
            read = torch.cat([text[:, :1], predicted[:, :-1]], dim=1)
        return loss / self.unroll, stats


def batches(samples: list[FeatureSample], tokens_per_batch: int, seed: int) -> list[list[FeatureSample]]:
    """Samples of similar length together (less padding), each batch up to `tokens_per_batch` padded tokens,
    in a seeded random order."""
    ordered = sorted(samples, key=lambda s: len(s.ids))
    out, current = [], []
    for sample in ordered:
        if current and (len(current) + 1) * len(sample.ids) > tokens_per_batch:
            out.append(current)
            current = []
        current.append(sample)
    if current:
        out.append(current)
    random.Random(seed).shuffle(out)
    return out


def collate(batch: list[FeatureSample], base_model: nn.Module, aux_layers: tuple[int, ...] = ()) -> tuple:
    """(ids [B, L], features [B, L, H] float32, mask [B, L], aux [B, L, A*H] float32 or None) right-padded on the
    base model's device; the mask marks positions p whose token p+2 is an answer token; aux: the inputs of
    `aux_layers`. Features not kept are computed now (right padding does not change a causal model's features
    before it; the padding's own are zeroed, as kept ones leave it)."""
    width = max(len(s.ids) for s in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, sample in enumerate(batch):
        ids[row, : len(sample.ids)] = sample.ids
        mask[row, max(sample.answer_start - 2, 0) : len(sample.ids) - 2] = True
    if batch[0].features is None:
        with torch.no_grad():
            features, aux = base_hidden(base_model, ids.to(base_model.device), aux_layers)
        lengths = torch.tensor([len(s.ids) for s in batch], device=features.device)
        padding = torch.arange(width, device=features.device) >= lengths.unsqueeze(1)
        features, aux = features.float(), None if aux is None else aux.float()
        for tensor in (features, aux):
            if tensor is not None:
                tensor[padding] = 0  # as kept features leave it
    else:
        features = _padded([s.features for s in batch], width)
        aux = _padded([s.aux for s in batch], width) if aux_layers else None
    device = base_model.device
    return ids.to(device), features.to(device), mask.to(device), None if aux is None else aux.to(device)


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width, rows[0].shape[1]))
    for row, tensor in enumerate(rows):
        out[row, : len(tensor)] = tensor.float()
    return out


def train_drafter(loss_fn: DrafterLoss, samples: list[FeatureSample], epochs: float, lr: float,
                  tokens_per_batch: int, seed: int = 0, progress=None, log=None) -> int:
    """AdamW with a cosine schedule over `epochs` passes; returns the optimiser steps taken."""
    parameters = [p for p in loss_fn.drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    plan = [b for epoch in range(math.ceil(epochs)) for b in batches(samples, tokens_per_batch, seed + epoch)]
    plan = plan[: max(1, round(len(plan) * epochs / math.ceil(epochs)))]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / len(plan))))
    if progress is not None:
        progress.reset(total=len(plan))
    for step, batch in enumerate(plan):
        loss, stats = loss_fn(*collate(batch, loss_fn.base_model, loss_fn.drafter.aux_layers))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}", top1=f"{stats['pass0_top1']:.3f}")
        if log is not None and step % 50 == 0:
            log(step, loss.item(), stats)
    return len(plan)


@torch.inference_mode()
def depth_accuracy(drafter: FeatureDrafter, base_model: nn.Module, samples: list[FeatureSample], depth: int,
                   ranks: int = 10, positions_per_sample: int = 16) -> list[list[float]]:
    """acc[d][r]: how often the drafter's rank-r token at draft level d+1 is the base model's token, drafting as
    at decoding time (its own features below the first level) along the true tokens, from answer positions of
    held-out samples; the table the tree builder and the runtime's choice read."""
    drafter = copy.deepcopy(drafter).to(base_model.dtype)  # decoding drafts in the base model's dtype
    embeddings = base_model.get_input_embeddings()
    proposals = drafter.proposal_lm_head(base_model.lm_head)
    slot = FeatureCacheSlot(base_model, drafter)
    hits = torch.zeros(depth, ranks)
    counts = torch.zeros(depth)
    device = base_model.device
    for sample in samples:
        length = len(sample.ids)
        cache = slot.get(length, depth)
        ids = sample.ids.to(device)
        aux = None if sample.aux is None else sample.aux.to(device)
        features = drafter.text_features(sample.features.to(device), aux)
        all_positions = torch.arange(length - 1, device=device)
        states = read_positions(drafter, embeddings, cache, ids[1:], features[:-1], all_positions, all_positions, None)
        starts = list(range(max(sample.answer_start - 1, 0), length - 2))
        for t in starts[:: max(1, len(starts) // positions_per_sample)][:positions_per_sample]:
            # text up to t read with base features (t's output predicts the feature of t+1, the root's position)
            state = states[t : t + 1]
            visible = torch.arange(cache.slots, device=device) <= t
            for level in range(depth):
                target = t + 2 + level
                if target >= length:
                    break
                logits = drafter.project(state, proposals)[0]
                order = drafter.token_ids(logits.topk(ranks).indices)
                found = (order == ids[target]).nonzero()
                counts[level] += 1
                if len(found):
                    hits[level, found[0, 0]] += 1
                slot_id = torch.tensor([cache.capacity + level], device=device)
                visible = visible.clone()
                visible[cache.capacity + level] = True
                state = read_positions(drafter, embeddings, cache, ids[target : target + 1], state,
                                       torch.tensor([t + 1 + level], device=device), slot_id, visible.unsqueeze(0))
    return [[round((hits[d, r] / counts[d]).item(), 4) if counts[d] else 0.0 for r in range(ranks)] for d in range(depth)]
