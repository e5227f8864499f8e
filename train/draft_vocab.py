"""Give trained shared-lm_head heads a draft vocabulary: the tokens the base model emits most often.

The heads then score proposals over those K rows of the lm_head only (K/V of the full projection per
step); verification still uses the whole vocabulary, so output does not change, only which tokens can be
proposed. Counted on the distillation data's answers, i.e. the base model's own output.

    python train/draft_vocab.py --heads train/demo_heads --data data/train.jsonl --size 4096

Check the accuracy it costs with train/medusa_tree_builder.py (it scores through the draft vocabulary).
Heads that already carry a draft vocabulary are refused: heads trained over one (train_medusa.py
--draft_vocab_size) learned only its rows, and a different one would have them propose from rows they never
scored.
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch

from inference.runtime.arguments import ArgumentParser, positive_int
from inference.runtime.errors import UserError, run_command
from inference.runtime.loading import resolve_model_dir
from inference.runtime.medusa_heads import (COMBINED_CONFIG, MedusaHeads, MedusaLoadError, is_one_checkpoint, load_heads,
                                    read_medusa_config, save_heads)
from train.medusa_training import draft_vocabulary, read_samples


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", required=True, help="heads directory to update in place (train_medusa.py --out)")
    parser.add_argument("--data", required=True, help="distillation JSONL the frequencies are counted on")
    parser.add_argument("--size", type=positive_int, default=8192, help="tokens kept (fewer if the data has fewer distinct ones)")
    return parser.parse_args(argv)


def with_draft_vocab(heads: MedusaHeads, tokens: list[int]) -> MedusaHeads:
    """A copy of `heads` whose proposals come from `tokens` only."""
    config = replace(heads.config, medusa_draft_vocab_size=len(tokens))
    updated = MedusaHeads(config, config.hidden_size, config.vocab_size)
    updated.load_state_dict(heads.state_dict() | {"draft_vocab": torch.tensor(tokens, dtype=torch.long)})
    return updated


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        directory = resolve_model_dir(args.heads)
        if is_one_checkpoint(directory):
            raise UserError(f"{directory} keeps its heads inside the model weights: add the draft vocabulary to "
                            "the heads directory before combining")
        config = read_medusa_config(directory)
        if config is None or config.hidden_size is None or config.vocab_size is None:
            raise MedusaLoadError(f"{directory} has no heads config with hidden_size and vocab_size")
        if config.medusa_draft_vocab_size:
            raise UserError(f"{directory} already proposes from a {config.medusa_draft_vocab_size}-token draft "
                            "vocabulary; heads trained over one learned only its rows, so retrain with "
                            "train_medusa.py --draft_vocab_size for another")
        heads = load_heads(directory, config.hidden_size, config.vocab_size)
        tokens = draft_vocabulary(read_samples(args.data), args.size, config.vocab_size)
        save_heads(with_draft_vocab(heads, tokens), directory, combined=(Path(directory) / COMBINED_CONFIG).is_file())
        print(f"{directory}: proposals from the {len(tokens)} most frequent tokens of {args.data}", file=sys.stderr)

    return run_command(body, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
