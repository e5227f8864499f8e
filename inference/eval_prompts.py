"""Evaluation prompt sets for `benchmark.py --prompts`, cut reproducibly from MT-Bench, GSM8K and the built-in set.

Acceptance is reported on prompts nothing was chosen on; this names such a set by a command instead of a
hand-made file (the question files are not in the repository):

    python inference/eval_prompts.py --mt_bench ../shared/data/mt_bench_questions.jsonl --per_category 3 \\
        --builtin --gsm8k ../shared/data/gsm8k_test.jsonl --gsm8k_count 6 --out eval_prompts.jsonl
"""

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

from inference.benchmark import load_benchmark_prompts
from inference.runtime.arguments import ArgumentParser, non_negative_int
from inference.runtime.errors import UserError, run_command
from inference.runtime.jsonl import jsonl_lines
from inference.runtime.outputs import check_output_file, write_atomic


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mt_bench", help="MT-Bench questions jsonl (question_id, category, turns); first turns are used")
    parser.add_argument("--per_category", type=non_negative_int, default=3, help="MT-Bench questions per category")
    parser.add_argument("--skip_per_category", type=non_negative_int, default=0,
                        help="MT-Bench questions skipped first in each category (a second set that does not "
                        "overlap the first)")
    parser.add_argument("--builtin", action="store_true", help="add benchmark.py's built-in prompts")
    parser.add_argument("--gsm8k", help="GSM8K test jsonl (question, answer)")
    parser.add_argument("--gsm8k_count", type=non_negative_int, default=6, help="GSM8K questions, in file order")
    parser.add_argument("--gsm8k_skip", type=non_negative_int, default=0, help="GSM8K questions skipped first")
    parser.add_argument("--out", required=True, help="jsonl of {category, prompt} for benchmark.py --prompts")
    return parser.parse_args(argv)


def _records(path: str, fields: tuple[str, ...]) -> Iterator[dict]:
    if not Path(path).is_file():
        raise UserError(f"{path} does not exist")
    for number, line in jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number} is not valid JSON: {error}") from None
        if not isinstance(record, dict) or any(field not in record for field in fields):
            raise UserError(f"{path}:{number} needs the fields {', '.join(fields)}")
        yield record


def mt_bench_prompts(path: str, count: int, skip: int = 0) -> list[dict]:
    """The first turn of questions skip .. skip + count - 1 of every category, in file order."""
    seen: dict[str, int] = defaultdict(int)
    chosen = []
    for record in _records(path, ("category", "turns")):
        index = seen[record["category"]]
        seen[record["category"]] += 1
        if skip <= index < skip + count:
            chosen.append({"category": record["category"], "prompt": str(record["turns"][0])})
    return chosen


def gsm8k_prompts(path: str, count: int, skip: int = 0) -> list[dict]:
    """Questions skip .. skip + count - 1, as asked (the worked answers are not used)."""
    records = list(_records(path, ("question",)))[skip : skip + count]
    return [{"category": "gsm8k", "prompt": record["question"]} for record in records]


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        check_output_file(args.out)
        prompts = mt_bench_prompts(args.mt_bench, args.per_category, args.skip_per_category) if args.mt_bench else []
        prompts += load_benchmark_prompts(None, None) if args.builtin else []
        prompts += gsm8k_prompts(args.gsm8k, args.gsm8k_count, args.gsm8k_skip) if args.gsm8k else []
        if not prompts:
            raise UserError("no prompts chosen: give --mt_bench, --builtin or --gsm8k")
        write_atomic(args.out, "".join(json.dumps(prompt, ensure_ascii=False) + "\n" for prompt in prompts))
        counts = Counter(prompt["category"] for prompt in prompts)
        summary = ", ".join(f"{category} {count}" for category, count in counts.items())
        print(f"{len(prompts)} prompts in {args.out} ({summary})", file=sys.stderr)

    return run_command(body, "interrupted")


if __name__ == "__main__":
    sys.exit(main())
