"""How often context-lookup guesses are right, by match length: the scores the dynamic tree ranks them by.

At every answer position of held-out distillation records (the base model's own greedy answers), the
lookup guesses the next tokens from the prompt and the answer so far, exactly as decoding does; a guess
counts as right while it equals the answer. `inference/engine/context_lookup.py` keeps the rates as
FIRST_TOKEN_ACCURACY (the first guessed token, by the length of the match) and NEXT_TOKEN_ACCURACY (each
later token, given the ones before it were right).

    python train/lookup_accuracy.py --data data/heldout_sharegpt.jsonl
"""

import sys
from collections import Counter

from inference.engine.context_lookup import MAX_MATCH, ContextLookup
from inference.runtime.arguments import ArgumentParser, positive_int
from inference.runtime.errors import run_command
from train.medusa_training import read_samples


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, nargs="+", help="held-out distillation JSONL (never trained on)")
    parser.add_argument("--depth", type=positive_int, default=8, help="guessed tokens scored per position")
    return parser.parse_args(argv)


def lookup_accuracy(samples: list[dict], depth: int) -> tuple[dict[int, tuple[float, int]], dict[int, tuple[float, int]]]:
    """({match length: (first-token accuracy, guesses)}, {match length: (later-token accuracy, tokens tried)})."""
    first_right, first_tried, later_right, later_tried = Counter(), Counter(), Counter(), Counter()
    for sample in samples:
        answer = sample["output_ids"]
        lookup = ContextLookup(sample["prompt_ids"] + answer[:1])
        for position in range(1, len(answer)):
            guessed, match = lookup.find(min(depth, len(answer) - position))
            for offset, token in enumerate(guessed):
                right, tried = (first_right, first_tried) if offset == 0 else (later_right, later_tried)
                tried[match] += 1
                if token != answer[position + offset]:
                    break
                right[match] += 1
            lookup.extend(answer[position : position + 1])

    def rates(right: Counter, tried: Counter) -> dict[int, tuple[float, int]]:
        return {n: (right[n] / tried[n], tried[n]) for n in range(MAX_MATCH, 0, -1) if tried[n]}

    return rates(first_right, first_tried), rates(later_right, later_tried)


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        samples = [sample for path in args.data for sample in read_samples(path)]
        first, later = lookup_accuracy(samples, args.depth)
        positions = sum(len(sample["output_ids"]) - 1 for sample in samples)
        print(f"{len(samples)} answers, {positions} positions")
        print(f"{'match':>5} {'first token':>12} {'guesses':>8} {'later tokens':>13} {'tried':>7}")
        for n in sorted(first, reverse=True):
            accuracy, guesses = first[n]
            later_accuracy, tried = later.get(n, (0.0, 0))
            print(f"{n:>5} {accuracy:>12.3f} {guesses:>8} {later_accuracy:>13.3f} {tried:>7}")

    return run_command(body, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
