"""Shared pieces of the Medusa tests: prompts, references and heads fitted to a model's own outputs."""

import os
import random

import torch

from inference.engine.decoding import DecodeRequest
from inference.engine.plain_decoding import plain_decode
from inference.engine.step_schedule import FixedSchedule, StepOption
from inference.runtime.feature_drafter import new_feature_drafter
from medusa_model import MedusaConfig, MedusaHeads

# Where the decoding tests that take the `pangu_on_device` fixture run (OPENPANGU_MEDUSA_TEST_DEVICE=cuda for a GPU
# check); every other test runs on the CPU.
TEST_DEVICE = torch.device(os.environ.get("OPENPANGU_MEDUSA_TEST_DEVICE", "cpu"))


def random_prompts(vocab_size: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 24, (count,), generator=generator).tolist()
    return [[1] + torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def plain_greedy(model, prompt: list[int], max_new_tokens: int, eos=()) -> list[int]:
    return [t for step in plain_decode(model, DecodeRequest(prompt, max_new_tokens, tuple(eos))) for t in step]


def random_heads(model, num_heads: int = 4, seed: int = 0, std: float = 0.05, layout: str = "shared_lm_head",
                 head_input: str = "hidden", draft_vocab: list[int] | None = None, aux_layers: list[int] | None = None):
    """Random heads of any design; `head_input` "features": a feature drafter drafting `num_heads` levels (fusing
    the inputs of `aux_layers`)."""
    torch.manual_seed(seed)
    c = model.config
    if head_input == "features":
        drafter = new_feature_drafter(model, num_heads, draft_vocab=draft_vocab, aux_layers=aux_layers)
        for name, p in drafter.named_parameters():
            torch.nn.init.normal_(p, mean=1.0 if name.endswith("layernorm.weight") else 0.0, std=std)
        return drafter.to(device=model.device, dtype=model.dtype)
    config = MedusaConfig(num_heads, 1, layout, c.hidden_size, c.vocab_size, medusa_head_input=head_input,
                          medusa_draft_vocab_size=len(draft_vocab) if draft_vocab else None)
    heads = MedusaHeads(config, c.hidden_size, c.vocab_size)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=std)
    if draft_vocab:
        heads.draft_vocab.copy_(torch.tensor(draft_vocab))
    return heads.to(device=model.device, dtype=model.dtype)


def upper_half_vocab(model) -> list[int]:
    """A draft vocabulary none of whose ids is a valid index into it (so a missed index-to-id map shows)."""
    return list(range(model.config.vocab_size // 2, model.config.vocab_size))


@torch.no_grad()
def _hidden_states(model, sequence: list[int]) -> torch.Tensor:
    return model.model(input_ids=torch.tensor([sequence], device=model.device)).last_hidden_state[0]


def fit_heads(model, prompts: list[list[int]], max_new_tokens: int, num_heads: int = 4, steps: int = 300,
              seed: int = 0, head_input: str = "hidden") -> MedusaHeads:
    """Train own-lm_head heads on the model's greedy continuations: head i at position t -> token t+2+i (heads
    that read tokens after t get the true ones)."""
    torch.manual_seed(seed)
    c = model.config
    config = MedusaConfig(num_heads, 1, "own_lm_head", c.hidden_size, c.vocab_size, medusa_head_input=head_input)
    heads = MedusaHeads(config, c.hidden_size, c.vocab_size).to(model.device)
    heads.init_from_lm_head(model.lm_head)
    inputs, targets, following = [], [], []
    for prompt in prompts:
        sequence = prompt + plain_greedy(model, prompt, max_new_tokens)
        hidden = _hidden_states(model, sequence)
        for t in range(len(prompt) - 1, len(sequence) - 2):
            inputs.append(hidden[t])
            targets.append([sequence[t + 2 + i] if t + 2 + i < len(sequence) else -100 for i in range(num_heads)])
            following.append([sequence[t + 1 + i] if t + 1 + i < len(sequence) else 0 for i in range(num_heads)])
    x, y = torch.stack(inputs), torch.tensor(targets, device=model.device)
    with torch.no_grad():
        embeds = heads.token_embeds(model.get_input_embeddings(), torch.tensor(following, device=model.device))
    optimizer = torch.optim.Adam(heads.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = heads(x, model.lm_head, token_embeds=embeds)  # [heads, N, V]
        loss = sum(torch.nn.functional.cross_entropy(logits[i], y[:, i], ignore_index=-100) for i in range(num_heads))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return heads.eval()


class ScriptedSchedule(FixedSchedule):
    """Runs its trees (None: a plain step) in a fixed pseudo-random order, whatever they cost: a forced switch
    at most steps."""

    def __init__(self, trees: list, seed: int = 0):
        self.options = tuple(StepOption(tree, 1.0, 1.0) for tree in trees)
        self.order = random.Random(seed)

    def next(self, stats, expected=None) -> int:
        return self.order.randrange(len(self.options))


def fit_feature_drafter(model, prompts: list[list[int]], max_new_tokens: int, levels: int = 4, steps: int = 60,
                        seed: int = 0, aux_layers: tuple[int, ...] = (), layers: int = 1):
    """A feature drafter of `layers` decoder layers trained (as train/train_feature_drafter.py does) on the model's
    greedy continuations, fusing the inputs of `aux_layers` if any."""
    from train.feature_drafter_training import DrafterLoss, base_features, train_drafter

    torch.manual_seed(seed)
    samples = [{"prompt_ids": p, "output_ids": plain_greedy(model, p, max_new_tokens)} for p in prompts]
    drafter = new_feature_drafter(model, levels, aux_layers=list(aux_layers), layers=layers)
    train_drafter(DrafterLoss(drafter, model, unroll=2, token_weight=1.0),
                  base_features(model, samples, 4096, aux_layers=aux_layers), steps, 3e-3, 2000, seed)
    return drafter.eval()
