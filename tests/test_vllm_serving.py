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
DEMO_DRAFTER = ROOT / "train" / "demo_drafter"
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


def test_vllm_serves_the_exported_demo_heads_exactly_and_accepts_as_our_engine_does(demo_dir, demo_model, tmp_path):
    model, tokenizer = demo_model
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    exported = tmp_path / "medusa_vllm"
    assert convert_medusa.main(["--medusa_dir", str(VLLM_HEADS), "--out", str(exported), "--layout", "vllm",
                                "--dtype", "fp32"]) == 0
    plain = run_vllm(tmp_path, "plain", demo_dir, prompts)
    speculative = run_vllm(tmp_path, "medusa", demo_dir, prompts, "--speculator", str(exported),
                           "--num_speculative_tokens", "3")
    assert speculative["outputs"] == plain["outputs"]  # speculation never changes greedy output
    assert speculative["drafts"] > 0
    vllm_tokens_per_step = 1 + speculative["accepted"] / speculative["drafts"]

    heads = load_heads(VLLM_HEADS, model.config.hidden_size, model.config.vocab_size).float()
    heads.draft_vocab = None  # as exported: vLLM proposes over the whole vocabulary
    decoder, stats = MedusaDecoder(model, heads), DecodeStats()
    for prompt in prompts:  # the same chain vLLM drafts: each head's top-1
        list(decoder.decode(DecodeRequest(prompt, NEW_TOKENS), load_tree("chain_3"), stats=stats))
    ours = (stats.new_tokens - len(prompts)) / stats.steps  # tokens per verification step, as vLLM's 1 + accepted/draft
    assert abs(vllm_tokens_per_step - ours) <= 0.15 * ours, (vllm_tokens_per_step, ours)
    assert ours > 1.15  # trained heads (1.24 measured): a dropped weight would leave vLLM near 1.0


def test_vllm_serves_the_exported_demo_drafter_exactly_and_accepts_as_our_engine_does(demo_dir, demo_model, tmp_path):
    model, tokenizer = demo_model
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    exported = tmp_path / "eagle_vllm"
    assert convert_medusa.main(["--medusa_dir", str(DEMO_DRAFTER), "--out", str(exported), "--layout", "vllm",
                                "--dtype", "fp32", "--medusa_choices", "dynamic:16"]) == 0
    chain = 3
    plain = run_vllm(tmp_path, "plain", demo_dir, prompts)
    speculative = run_vllm(tmp_path, "eagle", demo_dir, prompts, "--speculator", str(exported), "--method", "eagle",
                           "--num_speculative_tokens", str(chain))
    assert speculative["outputs"] == plain["outputs"]  # speculation never changes greedy output
    assert speculative["drafts"] > 0
    vllm_tokens_per_step = 1 + speculative["accepted"] / speculative["drafts"]

    drafter = load_heads(DEMO_DRAFTER, model.config.hidden_size, model.config.vocab_size).float()
    drafter.draft_vocab = None  # as exported: vLLM proposes over the whole vocabulary
    decoder, stats = MedusaDecoder(model, drafter), DecodeStats()
    for prompt in prompts:  # the chain vLLM drafts: the drafter's top-1, `chain` levels deep
        list(decoder.decode(DecodeRequest(prompt, NEW_TOKENS), DynamicTree(chain, top_k=1, expand=1, lookup=0),
                            stats=stats))
    ours = (stats.new_tokens - len(prompts)) / stats.steps
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
