"""Give trained shared-lm_head heads a draft vocabulary: the tokens the base model emits most often.

The heads then score proposals over those K rows of the lm_head only (K/V of the full projection per
step); verification still uses the whole vocabulary, so output does not change, only which tokens can be
proposed. Counted on the distillation data's answers, i.e. the base model's own output.

    python train/draft_vocab.py --heads train/demo_heads --data data/train.jsonl --size 4096

Check the accuracy it costs with train/medusa_tree_builder.py (it scores through the draft vocabulary).
Heads that already carry a draft vocabulary get no other: heads trained over one (train_medusa.py
--draft_vocab_size) learned only its rows, and a different one would have them propose from rows they never
scored. `--keep K` cuts one to its K most frequent tokens instead (rows they did learn), for hardware where
scoring the whole draft vocabulary costs more than the proposals it adds:

    python train/draft_vocab.py --heads runs/drafter16k --keep 4096
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
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", help="distillation JSONL the frequencies are counted on")
    source.add_argument("--keep", type=positive_int, help="heads (or a feature drafter) with a draft vocabulary: keep "
                        "only its K most frequent tokens (no --data needed)")
    parser.add_argument("--size", type=positive_int, default=8192, help="tokens kept (fewer if the data has fewer distinct ones)")
    return parser.parse_args(argv)


def with_draft_vocab(heads: MedusaHeads, tokens: list[int]) -> MedusaHeads:
    """A copy of `heads` (Medusa heads or a feature drafter) whose proposals come from `tokens` only."""
    config = replace(heads.config, medusa_draft_vocab_size=len(tokens))
    updated = type(heads)(config, config.hidden_size, config.vocab_size)
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
        size = config.medusa_draft_vocab_size
        if args.keep is not None:
            if not size or args.keep >= size:
                raise UserError(f"--keep cuts a draft vocabulary to fewer tokens; {directory} proposes from "
                                f"{f'{size} tokens' if size else 'the whole vocabulary'}")
        elif size:
            raise UserError(f"{directory} already proposes from a {size}-token draft vocabulary; heads trained over "
                            "one learned only its rows, so retrain with train_medusa.py --draft_vocab_size for another, "
                            "or cut it with --keep")
        elif args.data is None:
            raise UserError("--data gives the answers whose most frequent tokens become the draft vocabulary")
        heads = load_heads(directory, config.hidden_size, config.vocab_size)
        if args.keep is not None:
            tokens, source = heads.draft_vocab[: args.keep].tolist(), f"its {size}-token draft vocabulary"
        else:
            tokens, source = draft_vocabulary(read_samples(args.data), args.size, config.vocab_size), args.data
        save_heads(with_draft_vocab(heads, tokens), directory, combined=(Path(directory) / COMBINED_CONFIG).is_file())
        print(f"{directory}: proposals from the {len(tokens)} most frequent tokens of {source}", file=sys.stderr)
        if args.keep is not None and config.medusa_head_accuracy:
            print("its recorded accuracy was measured over all of them: train/medusa_tree_builder.py "
                  "--save_in_heads measures it again", file=sys.stderr)

    return run_command(body, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
