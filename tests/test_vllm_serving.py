"""The exported heads and feature drafter served by a real vLLM (`make test-vllm`, which builds .venv-vllm first).

vLLM runs in its own environment (it pins an older transformers), through tests/vllm/run_vllm.py; this
side exports the heads, runs this project's engine on the same prompts and compares.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference import convert_medusa
from inference.engine.decoding import DecodeRequest, DecodeStats
from inference.engine.medusa_decoding import MedusaDecoder
from inference.runtime.chat import prompt_ids
from inference.runtime.loading import load_causal_lm
from medusa_choices import DynamicTree, load_tree
from medusa_helpers import plain_greedy, random_prompts
from medusa_model import load_heads
from tiny_pangu import write_tiny_pangu

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "tests" / "vllm" / "run_vllm.py"
VLLM_HEADS = ROOT / "train" / "demo_heads_vllm"
DEMO_DRAFTER = ROOT / "train" / "demo_drafter_vllm"  # the unfused drafter vLLM's `eagle` loads
QUESTIONS = ["Give me three tips for staying focused while studying.", "Write a short poem about autumn leaves.",
             "Explain what a hash table is.", "How do I make a cup of green tea?",
             "Write a Python function that reverses a string.", "What causes the seasons on Earth?"]
NEW_TOKENS = 64


def run_vllm(tmp_path: Path, name: str, model: Path, prompts: list[list[int]], *extra: str) -> dict:
    if not VLLM_PYTHON.is_file():
        pytest.fail("no vLLM environment: run `make test-vllm` (it builds .venv-vllm)")
    prompt_file, out = tmp_path / f"{name}_prompts.json", tmp_path / f"{name}.json"
    prompt_file.write_text(json.dumps(prompts))
    subprocess.run([str(VLLM_PYTHON), str(RUNNER), "--model", str(model), "--prompts", str(prompt_file),
                    "--max_tokens", str(NEW_TOKENS), "--out", str(out), *extra], check=True, timeout=1200,
                   stdout=sys.stderr)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def served_plain(demo_dir, demo_model, tmp_path_factory) -> tuple[list[list[int]], list[list[int]]]:
    """(the chat-templated QUESTIONS, vLLM's plain greedy ids for them): what both speculators must reproduce."""
    prompts = [prompt_ids(demo_model[1], [{"role": "user", "content": q}]) for q in QUESTIONS]
    return prompts, run_vllm(tmp_path_factory.mktemp("plain"), "plain", demo_dir, prompts)["outputs"]


def served_tokens_per_step(tmp_path: Path, demo_dir: Path, served_plain, drafter: Path, method: str, chain: int) -> float:
    """Export `drafter` for vLLM, serve it as `method` drafting `chain` tokens, check its greedy ids are the plain
    ones and return its tokens per step (1 + accepted / drafts)."""
    prompts, plain = served_plain
    exported = tmp_path / f"{method}_vllm"
    assert convert_medusa.main(["--medusa_dir", str(drafter), "--out", str(exported), "--layout", "vllm",
                                "--dtype", "fp32"]) == 0
    speculative = run_vllm(tmp_path, method, demo_dir, prompts, "--speculator", str(exported), "--method", method,
                           "--num_speculative_tokens", str(chain))
    assert speculative["outputs"] == plain  # speculation never changes greedy output
    assert speculative["drafts"] > 0
    return 1 + speculative["accepted"] / speculative["drafts"]


def our_tokens_per_step(model, drafter: Path, prompts: list[list[int]], tree) -> float:
    """Tokens per verification step of this project's engine with `drafter` as exported (vLLM proposes over the
    whole vocabulary, so without its draft vocabulary), as vLLM counts them."""
    heads = load_heads(drafter, model.config.hidden_size, model.config.vocab_size).float()
    heads.draft_vocab = None
    decoder, stats = MedusaDecoder(model, heads), DecodeStats()
    for prompt in prompts:
        list(decoder.decode(DecodeRequest(prompt, NEW_TOKENS), tree, stats=stats))
    return (stats.new_tokens - len(prompts)) / stats.steps


def test_vllm_serves_the_exported_demo_heads_exactly_and_accepts_as_our_engine_does(demo_dir, demo_model, served_plain,
                                                                                    tmp_path):
    vllm_tokens_per_step = served_tokens_per_step(tmp_path, demo_dir, served_plain, VLLM_HEADS, "medusa", 3)
    ours = our_tokens_per_step(demo_model[0], VLLM_HEADS, served_plain[0], load_tree("chain_3"))  # each head's top-1
    assert abs(vllm_tokens_per_step - ours) <= 0.15 * ours, (vllm_tokens_per_step, ours)
    assert ours > 1.15  # trained heads (1.24 measured): a dropped weight would leave vLLM near 1.0


def test_vllm_serves_the_exported_demo_drafter_exactly_and_accepts_as_our_engine_does(demo_dir, demo_model, served_plain,
                                                                                      tmp_path):
    vllm_tokens_per_step = served_tokens_per_step(tmp_path, demo_dir, served_plain, DEMO_DRAFTER, "eagle", 3)
    chain = DynamicTree(3, top_k=1, expand=1, lookup=0)  # the chain vLLM drafts: the drafter's top-1, 3 levels deep
    ours = our_tokens_per_step(demo_model[0], DEMO_DRAFTER, served_plain[0], chain)
    assert abs(vllm_tokens_per_step - ours) <= 0.15 * ours, (vllm_tokens_per_step, ours)
    assert ours > 1.3  # a trained drafter: a dropped weight would leave vLLM near 1.0


def test_vllm_runs_the_openpangu_model_as_this_project_does(tmp_path):
    directory = tmp_path / "tiny_pangu_hd64"
    # head_dim 64 (vLLM's CPU attention refuses 16); bias, GQA, rope_theta 1.6e7, bf16 shards, inv_freq keys
    write_tiny_pangu(directory, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    model = load_causal_lm(directory, torch.device("cpu"), torch.float32)
    prompts = random_prompts(model.config.vocab_size, count=4, seed=1)
    ours = [plain_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    assert run_vllm(tmp_path, "pangu", directory, prompts)["outputs"] == ours


def test_vllm_distillation_writes_the_greedy_answers_our_engine_decodes(demo_dir, demo_model, tmp_path):
    """`gen_distill_data.py --engine vllm`: the records hold, per prompt, the model's fp32 greedy answer up to and
    including its EOS, as this project's plain decoding gives it."""
    from train import gen_distill_data

    if not VLLM_PYTHON.is_file():
        pytest.fail("no vLLM environment: run `make test-vllm` (it builds .venv-vllm)")
    model, tokenizer = demo_model
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS[:3]))
    assert gen_distill_data.main(["--engine", "vllm", "--base_model", str(demo_dir), "--prompts", str(prompts),
                                  "--out", str(out), "--max_samples", "3", "--max_new_tokens", str(NEW_TOKENS),
                                  "--batch_size", "2", "--dtype", "fp32"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    eos = (model.generation_config.eos_token_id,)
    for record, question in zip(records, QUESTIONS):
        assert record["prompt_ids"] == prompt_ids(tokenizer, [{"role": "user", "content": question}])
        assert record["output_ids"] == plain_greedy(model, record["prompt_ids"], NEW_TOKENS, eos)
