"""What head training needs besides the Trainer: samples, targets, hidden-state caching, the loss.

Head i at position t is trained to predict token t+2+i (the base model's own lm_head predicts t+1).
Only positions whose targets are response tokens count; prompt tokens are masked. Heads that read
token t+1 (`medusa_head_input="hidden_and_next_token"`) get its embedding from the frozen base model.
"""

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from inference.errors import UserError
from inference.jsonl import jsonl_lines

IGNORE = -100


def read_samples(path: str | Path) -> list[dict]:
    """Distillation records with `prompt_ids` and `output_ids`; clear errors on empty or malformed data."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"training data {path} does not exist (make it with train/gen_distill_data.py)")
    samples = []
    for number, line in jsonl_lines(path):
        try:
            record = json.loads(line)
            prompt, output = record["prompt_ids"], record["output_ids"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{number} is not a distillation record with prompt_ids and output_ids") from None
        if not (isinstance(prompt, list) and isinstance(output, list) and prompt):
            raise UserError(f"{path}:{number}: prompt_ids and output_ids must be lists of token ids")
        if len(output) >= 2:
            samples.append({"prompt_ids": prompt, "output_ids": output})
    if not samples:
        raise UserError(f"{path} holds no usable samples (each needs an answer of at least 2 tokens)")
    return samples


def head_targets(prompt_len: int, ids: list[int], num_heads: int) -> torch.Tensor:
    """[len(ids), num_heads] targets: ids[t+2+i] where t >= prompt_len-1 and it exists, else IGNORE."""
    n = len(ids)
    targets = torch.full((n, num_heads), IGNORE, dtype=torch.long)
    sequence = torch.tensor(ids)
    for i in range(num_heads):
        start, stop = prompt_len - 1, n - 2 - i
        if stop > start:
            targets[start:stop, i] = sequence[start + 2 + i :]
    return targets


class SequenceDataset(Dataset):
    """Whole samples; the base model runs inside the training step (GPU/NPU training)."""

    def __init__(self, samples: list[dict], num_heads: int, max_length: int):
        self.items = []
        for s in samples:
            ids = (s["prompt_ids"] + s["output_ids"])[:max_length]
            self.items.append((ids, head_targets(len(s["prompt_ids"]), ids, num_heads)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        ids, targets = self.items[index]
        return {"input_ids": torch.tensor(ids), "labels": targets}


def pad_sequences(batch: list[dict], pad_id: int) -> dict:
    """Dynamic padding to the longest sample in the batch (right padding, masked out)."""
    width = max(len(item["input_ids"]) for item in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width, batch[0]["labels"].shape[1]), IGNORE, dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item["input_ids"])
        input_ids[row, :n], attention[row, :n], labels[row, :n] = item["input_ids"], 1, item["labels"]
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """Token t+1 for every position t (0 after the last one, where no head has a target)."""
    return torch.cat([input_ids[..., 1:], torch.zeros_like(input_ids[..., :1])], dim=-1)


class CachedPositions(Dataset):
    """One row per trainable position: the frozen base model's hidden state, token t+1, the heads' targets.

    With a frozen base, the base forward is the same in every epoch, so on a CPU it is run once and
    cached; training then touches only the heads and the (frozen) vocabulary projection.
    """

    def __init__(self, hidden: torch.Tensor, targets: torch.Tensor, next_ids: torch.Tensor):
        self.hidden, self.targets, self.next_ids = hidden, targets, next_ids

    def __len__(self):
        return self.hidden.shape[0]

    def __getitem__(self, index):
        return {"hidden_states": self.hidden[index], "next_ids": self.next_ids[index], "labels": self.targets[index]}


@torch.inference_mode()
def cache_hidden_states(base_model, samples: list[dict], num_heads: int, max_length: int, progress=None):
    """(hidden [N, H] in the model dtype, targets [N, num_heads], token t+1 [N]) for every position with a target."""
    hidden_rows, target_rows, next_rows = [], [], []
    for sample in samples:
        ids = (sample["prompt_ids"] + sample["output_ids"])[:max_length]
        targets = head_targets(len(sample["prompt_ids"]), ids, num_heads)
        keep = (targets != IGNORE).any(dim=1)
        hidden = base_model.model(input_ids=torch.tensor([ids], device=base_model.device)).last_hidden_state[0]
        hidden_rows.append(hidden[keep.to(hidden.device)].cpu())
        target_rows.append(targets[keep])
        next_rows.append(next_tokens(torch.tensor(ids))[keep])
        if progress is not None:
            progress.update()
    return torch.cat(hidden_rows), torch.cat(target_rows), torch.cat(next_rows)


class MedusaTrainingModule(nn.Module):
    """Heads + frozen base (or cached hidden states) -> weighted sum of per-head cross-entropies.

    `base_model` runs in the step (sequence batches) or is None (cached hidden states); its lm_head and
    input embeddings are used frozen either way. Only the heads are submodules: checkpoints, optimizer
    state and DeepSpeed see the heads alone, never a second copy of the base model.
    """

    def __init__(self, heads: nn.Module, lm_head: nn.Module, embeddings: nn.Module, base_model: nn.Module | None,
                 head_weights: list[float]):
        super().__init__()
        self.heads = heads
        for module in (lm_head, embeddings, base_model):
            if module is not None:
                module.requires_grad_(False)
        self.frozen = (lm_head, embeddings, base_model)  # a tuple: not registered as submodules
        self.head_weights = head_weights
        self.last_accuracy: list[tuple[float, float, int]] = []

    def forward(self, labels, hidden_states=None, next_ids=None, input_ids=None, attention_mask=None):
        lm_head, embeddings, base_model = self.frozen
        if hidden_states is None:
            with torch.no_grad():
                hidden_states = base_model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            next_ids = next_tokens(input_ids)
        hidden_states = hidden_states.to(next(self.heads.parameters()).dtype)
        next_embeds = self.heads.next_token_embeds(embeddings, next_ids)
        logits = self.heads(hidden_states, lm_head, next_embeds=next_embeds)  # [heads, ..., V]
        loss, accuracy = 0.0, []
        for i, weight in enumerate(self.head_weights):
            head_logits, target = logits[i].reshape(-1, logits.shape[-1]), labels[..., i].reshape(-1)
            valid = target != IGNORE
            if not valid.any():
                accuracy.append((0.0, 0.0, 0))
                continue
            loss = loss + weight * nn.functional.cross_entropy(head_logits[valid].float(), target[valid])
            with torch.no_grad():
                top5 = head_logits[valid].topk(5, dim=-1).indices
                hits = top5 == target[valid].unsqueeze(-1)
                accuracy.append((hits[:, 0].float().sum().item(), hits.any(-1).float().sum().item(), int(valid.sum())))
        self.last_accuracy = accuracy
        return {"loss": loss}
