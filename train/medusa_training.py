"""What head training needs besides the Trainer: samples, targets, hidden-state caching, the loss.

Head i at position t is trained to predict token t+2+i (the base model's own lm_head predicts t+1).
Only positions whose targets are response tokens count; prompt tokens are masked. Heads that read
tokens after t (t+1, or t+1 .. t+1+i for sequentially dependent heads) get the embeddings of the TRUE
tokens from the frozen base model (teacher forcing), which is what they see in a tree whose path so far
was accepted. With `soft_targets`, head i also learns the base model's whole distribution for token
t+2+i (its logits at position t+1+i, Hydra++'s teacher distillation), not only the token it chose.
"""

import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from inference.runtime.errors import UserError, first_line
from inference.runtime.jsonl import jsonl_lines
from inference.runtime.outputs import replace_atomic

IGNORE = -100
# The heads config of a training run, beside its checkpoints: config.json is written with the trained weights
# only, so an interrupted run never leaves a new config beside old weights.
RUN_CONFIG = "medusa_run_config.json"


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


def distinct(samples: list[dict]) -> list[dict]:
    """`samples` without repeats of an earlier one's prompt and answer (ShareGPT asks some prompts many times): a
    repeat would weigh its text more in training and, split to the held-out side, score text already trained on."""
    seen = set()
    kept = []
    for sample in samples:
        key = (tuple(sample["prompt_ids"]), tuple(sample["output_ids"]))
        if key not in seen:
            seen.add(key)
            kept.append(sample)
    return kept


def split_held_out(samples: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out) samples: a seeded shuffle, then `fraction` of them (at least one, where there are two
    or more) held out for accuracy."""
    samples = list(samples)
    random.Random(seed).shuffle(samples)
    held_out = max(1, int(len(samples) * fraction)) if len(samples) > 1 else 0
    return samples[held_out:], samples[:held_out]


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


def following_tokens(input_ids: torch.Tensor, count: int) -> torch.Tensor:
    """[..., L, count]: tokens t+1 .. t+count for every position t (0 past the end, where no head has a target)."""
    padded = torch.cat([input_ids, torch.zeros_like(input_ids[..., :count])], dim=-1)
    return torch.stack([padded[..., 1 + i : 1 + i + input_ids.shape[-1]] for i in range(count)], dim=-1)


class CachedPositions(Dataset):
    """One row per position of an answer: the frozen base model's hidden state, tokens t+1 .. t+num_heads,
    the heads' targets and, for soft targets, the hidden states at t+1 .. t+num_heads (whose lm_head logits
    are the base model's distributions over each head's target).

    With a frozen base, the base forward is the same in every epoch, so on a CPU it is run once and
    cached; training then touches only the heads and the (frozen) vocabulary projection. Rows of a sample
    are consecutive positions, so position t+1+i is row index+1+i wherever head i has a target at t.
    """

    def __init__(self, hidden: torch.Tensor, targets: torch.Tensor, following_ids: torch.Tensor,
                 soft_targets: bool = False):
        self.hidden, self.targets, self.following_ids = hidden, targets, following_ids
        self.soft_targets = soft_targets

    def __len__(self):
        return self.hidden.shape[0]

    def __getitem__(self, index):
        item = {"hidden_states": self.hidden[index], "following_ids": self.following_ids[index],
                "labels": self.targets[index]}
        if self.soft_targets:
            ahead = torch.arange(index + 1, index + 1 + self.targets.shape[1]).clamp(max=len(self) - 1)
            item["teacher_hidden"] = self.hidden[ahead]
        return item


def answer_span(sample: dict, max_length: int) -> tuple[list[int], slice]:
    """The sample's ids (cut to max_length) and its cached positions: the last prompt token to the one before
    the end (the last ones have no target but hold the base model's distribution for the one before)."""
    ids = (sample["prompt_ids"] + sample["output_ids"])[:max_length]
    return ids, slice(len(sample["prompt_ids"]) - 1, len(ids) - 1)


@torch.inference_mode()
def answer_hidden_states(base_model, samples: list[dict], max_length: int, progress=None) -> list[torch.Tensor]:
    """Per sample, the base model's last hidden states [positions, H] (model dtype, CPU) at its `answer_span`."""
    rows = []
    for sample in samples:
        ids, keep = answer_span(sample, max_length)
        hidden = base_model.model(input_ids=torch.tensor([ids], device=base_model.device)).last_hidden_state[0]
        rows.append(hidden[keep].cpu())
        if progress is not None:
            progress.update()
    return rows


def position_rows(samples: list[dict], hidden_rows: list[torch.Tensor], num_heads: int, max_length: int):
    """(hidden [N, H], targets [N, num_heads], tokens t+1 .. t+num_heads [N, num_heads]) of every cached position."""
    target_rows, following_rows = [], []
    for sample in samples:
        ids, keep = answer_span(sample, max_length)
        target_rows.append(head_targets(len(sample["prompt_ids"]), ids, num_heads)[keep])
        following_rows.append(following_tokens(torch.tensor(ids), num_heads)[keep])
    return torch.cat(hidden_rows), torch.cat(target_rows), torch.cat(following_rows)


def cache_hidden_states(base_model, samples: list[dict], num_heads: int, max_length: int, progress=None):
    """`position_rows` of `samples`, running the base model over each of them once."""
    return position_rows(samples, answer_hidden_states(base_model, samples, max_length, progress), num_heads, max_length)


def hidden_cache_path(data: Path, base_model, max_length: int) -> tuple[Path, dict]:
    """Where the hidden states of a data file are kept (beside it), and what they must have been made from."""
    stat = data.stat()
    source = {"data_bytes": stat.st_size, "data_mtime_ns": stat.st_mtime_ns, "max_length": max_length,
              "base_model": str(base_model.config._name_or_path), "dtype": str(base_model.dtype)}
    return data.with_name(data.name + ".hidden.pt"), source


def cached_answer_hidden_states(base_model, data: Path, samples: list[dict], max_length: int,
                                progress=None) -> list[torch.Tensor]:
    """`answer_hidden_states` of a data file's samples, from its cache file when that was made from the same file
    and base model, else computed and saved there: resuming or retraining does not pay for the base again. The
    cache only saves time, so a cache that cannot be written (a full disk) is a notice, not the end of the run."""
    path, source = hidden_cache_path(data, base_model, max_length)
    if path.is_file():
        try:
            cached = torch.load(path, map_location="cpu", weights_only=True)
            if cached.get("source") == source and len(cached["rows"]) == len(samples):
                if progress is not None:
                    progress.update(len(samples))
                return cached["rows"]
        except Exception as error:  # a corrupt cache (torch raises several kinds) is made again, not fatal
            print(f"hidden-state cache {path} is unreadable ({type(error).__name__}): computing it again",
                  file=sys.stderr)
    rows = answer_hidden_states(base_model, samples, max_length, progress)
    try:  # a kill mid-write never leaves a torn cache; the staging file is per process (torchrun ranks)
        replace_atomic(path, lambda staging: torch.save({"source": source, "rows": rows}, staging))
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
        print(f"hidden-state cache {path} could not be written ({first_line(error)}): training goes on "
              "without it", file=sys.stderr)
    return rows


def most_frequent_tokens(samples: list[dict], size: int) -> list[int]:
    """Up to `size` answer token ids, most frequent first (ties: lower id first): a draft vocabulary."""
    counts = Counter(token for sample in samples for token in sample["output_ids"])
    return sorted(counts, key=lambda token: (-counts[token], token))[:size]


def draft_vocabulary(samples: list[dict], size: int, vocab_size: int) -> list[int]:
    """`most_frequent_tokens` checked against the model they are for: a positive size, ids inside its vocabulary."""
    if size < 1:
        raise UserError("a draft vocabulary needs a size of at least 1")
    tokens = most_frequent_tokens(samples, size)
    if max(tokens) >= vocab_size:
        raise UserError(f"the distilled answers hold token ids beyond the model's vocabulary ({vocab_size})")
    return tokens


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of CE(softmax(teacher), student): the base model's whole distribution as the target."""
    return -(teacher_logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1).mean()


class MedusaTrainingModule(nn.Module):
    """Heads + frozen base (or cached hidden states) -> weighted sum of per-head cross-entropies.

    `base_model` runs in the step (sequence batches) or is None (cached hidden states); its lm_head and
    input embeddings are used frozen either way. Only the heads are submodules: checkpoints, optimizer
    state and DeepSpeed see the heads alone, never a second copy of the base model.

    Heads with a draft vocabulary train over it, as they propose at inference: logits (and soft targets) over
    its rows of the lm_head only, which is most of a step's cost for a large vocabulary; targets outside it,
    which no proposal can hit, are left out of the loss but counted in the accuracy.
    """

    def __init__(self, heads: nn.Module, lm_head: nn.Module, embeddings: nn.Module, base_model: nn.Module | None,
                 head_weights: list[float], soft_targets: bool = False):
        super().__init__()
        self.heads = heads
        for module in (lm_head, embeddings, base_model):
            if module is not None:
                module.requires_grad_(False)
        self.frozen = (lm_head, embeddings, base_model)  # a tuple: not registered as submodules
        self.head_weights = head_weights
        self.soft_targets = soft_targets
        self.last_accuracy: list[tuple[float, float, int]] = []
        self._proposal: tuple[torch.device, nn.Module, torch.Tensor | None] | None = None

    def proposal(self) -> tuple[nn.Module, torch.Tensor | None]:
        """(the heads' projection, token id -> its row or IGNORE), built once per device of the frozen lm_head,
        not in every step (the base model may move to its device after this module is built)."""
        lm_head = self.frozen[0]
        device = lm_head.weight.device
        if self._proposal is None or self._proposal[0] != device:
            draft_vocab = self.heads.draft_vocab
            index = None
            if draft_vocab is not None:
                draft_vocab = draft_vocab.to(device)
                index = torch.full((lm_head.weight.shape[0],), IGNORE, dtype=torch.long, device=device)
                index[draft_vocab] = torch.arange(len(draft_vocab), device=device)
            self._proposal = (device, self.heads.proposal_lm_head(lm_head), index)
        return self._proposal[1:]

    @staticmethod
    def draft_targets(labels: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """`labels` as rows of the proposal projection (IGNORE where the draft vocabulary lacks them)."""
        if index is None:
            return labels
        return torch.where(labels == IGNORE, IGNORE, index.to(labels.device)[labels.clamp(min=0)])

    def forward(self, labels, hidden_states=None, following_ids=None, teacher_hidden=None, input_ids=None,
                attention_mask=None):
        lm_head, embeddings, base_model = self.frozen
        if hidden_states is None:
            with torch.no_grad():
                hidden_states = base_model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            following_ids = following_tokens(input_ids, len(self.head_weights))
            if self.soft_targets:  # head i's teacher is position t+1+i (wrapped rows have no target)
                teacher_hidden = torch.stack(
                    [hidden_states.roll(-1 - i, dims=1) for i in range(len(self.head_weights))], dim=-2)
        hidden_states = hidden_states.to(next(self.heads.parameters()).dtype)
        projection, draft_index = self.proposal()
        token_embeds = self.heads.token_embeds(embeddings, following_ids)
        logits = self.heads(hidden_states, projection, token_embeds=token_embeds)  # [heads, ..., proposals]
        draft_labels = self.draft_targets(labels, draft_index)
        loss, accuracy = 0.0, []
        for i, weight in enumerate(self.head_weights):
            head_logits, target = logits[i].reshape(-1, logits.shape[-1]), draft_labels[..., i].reshape(-1)
            counted = int((labels[..., i] != IGNORE).sum())
            valid = target != IGNORE
            if not valid.any():
                accuracy.append((0.0, 0.0, counted))
                continue
            if self.soft_targets:
                with torch.no_grad():
                    teacher = projection(teacher_hidden[..., i, :].reshape(-1, teacher_hidden.shape[-1])[valid])
                head_loss = soft_cross_entropy(head_logits[valid], teacher)
            else:
                head_loss = nn.functional.cross_entropy(head_logits[valid].float(), target[valid])
            loss = loss + weight * head_loss
            with torch.no_grad():
                top5 = head_logits[valid].topk(min(5, head_logits.shape[-1]), dim=-1).indices
                hits = top5 == target[valid].unsqueeze(-1)
                accuracy.append((hits[:, 0].float().sum().item(), hits.any(-1).float().sum().item(), counted))
        self.last_accuracy = accuracy
        return {"loss": loss}
