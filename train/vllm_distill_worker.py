"""Answers prompts with a real vLLM for `gen_distill_data.py --engine vllm`, run in the vLLM environment.

vLLM batches the whole chunk continuously (paged KV cache, its compiled CPU kernels), about nine times the
answers per second of transformers' padded `generate` on the demo model. The process loads the model once and
then reads one JSON line per chunk from stdin (a list of prompts, each a list of token ids) and writes one JSON
line of answers (each up to and including its EOS) to stdout; everything vLLM prints goes to stderr.
"""

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the base model's directory")
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype: auto (the checkpoint's), bfloat16, float32, ...")
    parser.add_argument("--max_new_tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--eos", type=int, nargs="+", required=True, help="token ids that end an answer")
    parser.add_argument("--max_model_len", type=int, required=True)
    args = parser.parse_args()

    answers_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's own prints must not reach the answers' pipe
    sys.path.insert(0, str(ROOT))
    from inference.runtime.vllm_engine import start_vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = start_vllm(args.model, kv_cache_gib=4, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens,
                            stop_token_ids=args.eos, detokenize=False)
    for line in sys.stdin:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(line)]
        results = llm.generate(prompts, params, use_tqdm=False)
        answers_out.write(json.dumps([list(result.outputs[0].token_ids) for result in results]) + "\n")
        answers_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
