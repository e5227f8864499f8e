"""Greedy generation with a real vLLM, run inside the vLLM environment (.venv-vllm) by tests/test_vllm_serving.py.

    .venv-vllm/bin/python tests/vllm/run_vllm.py --model DIR --prompts ids.json --max_tokens 64 --out out.json \
        [--speculator DIR --method medusa|eagle --num_speculative_tokens 3]

Prompts are token ids (no tokenizer is needed); output: {"outputs": [[ids]...], "drafts": N, "accepted": N}.
OpenPangu directories are read through this project's config class, registered before vLLM starts (the
engine runs in this process so the registration holds there).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def spec_decode_counts(llm) -> tuple[int, int]:
    """(drafts, accepted draft tokens) from vLLM's metrics."""
    values = {}
    for metric in llm.get_metrics():
        if metric.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            values[metric.name] = values.get(metric.name, 0) + int(metric.value)
    return values.get("vllm:spec_decode_num_drafts", 0), values.get("vllm:spec_decode_num_accepted_tokens", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max_tokens", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--speculator", help="a drafter directory written by convert_medusa.py --layout vllm")
    parser.add_argument("--method", choices=("medusa", "eagle"), default="medusa",
                        help="the speculator's kind: Medusa heads, or the feature drafter")
    parser.add_argument("--num_speculative_tokens", type=int, default=3)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from inference.runtime.vllm_engine import start_vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = None
    if args.speculator:
        speculative = {"method": args.method, "model": args.speculator,
                       "num_speculative_tokens": args.num_speculative_tokens}
    llm = start_vllm(args.model, kv_cache_gib=2, dtype="float32", enforce_eager=True, max_model_len=1024,
                     disable_log_stats=False, speculative_config=speculative)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(Path(args.prompts).read_text())]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    outputs = [list(result.outputs[0].token_ids) for result in llm.generate(prompts, params, use_tqdm=False)]
    drafts, accepted = spec_decode_counts(llm) if speculative else (0, 0)
    Path(args.out).write_text(json.dumps({"outputs": outputs, "drafts": drafts, "accepted": accepted}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
