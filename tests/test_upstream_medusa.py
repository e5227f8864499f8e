"""The vendored upstream Medusa: patch series, its own medusa_generate, and the OpenPangu shim."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import medusa_compat
from inference.engine.tree_buffers import build_tree_buffers
from medusa_choices import load_tree, mc_sim_7b_63
from medusa_helpers import hf_greedy, random_heads, upper_half_vocab
from medusa_model import MedusaModel, save_heads
from tiny_pangu import write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
upstream = medusa_compat.load_upstream()


def run_script(repo: Path, *args: str) -> subprocess.CompletedProcess:
    wheel = ROOT / "third_party" / ".cache" / "medusa_llm-0.1-py3-none-any.whl"
    env = {"PATH": "/usr/bin:/bin", "MEDUSA_WHEEL": str(wheel), "PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    return subprocess.run(["bash", str(repo / "apply_patches.sh"), *args], capture_output=True, text=True, env=env)


@pytest.fixture
def repo_copy(tmp_path):
    shutil.copy(ROOT / "apply_patches.sh", tmp_path)
    shutil.copytree(ROOT / "patches", tmp_path / "patches")
    return tmp_path


def test_patch_series_applies_to_the_pinned_wheel_and_matches_checksums(repo_copy):
    first = run_script(repo_copy)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applied: ") == len(list((ROOT / "patches").glob("0*.patch")))
    second = run_script(repo_copy)
    assert second.returncode == 0 and "nothing changed" in second.stdout
    assert run_script(repo_copy, "--check").returncode == 0


def test_check_and_revert_report_the_true_state(repo_copy):
    run_script(repo_copy)
    assert run_script(repo_copy, "--revert").returncode == 0
    check = run_script(repo_copy, "--check")
    assert check.returncode == 1 and "pending" in check.stdout
    pristine = (repo_copy / "third_party/Medusa/medusa/model/utils.py").read_text()
    assert 'device="cuda"' in pristine


def test_a_patch_that_does_not_apply_fails_loudly(repo_copy):
    target = repo_copy / "patches" / "0003-gqa-kv-cache.patch"
    target.write_text(target.read_text().replace("batch_size = 1", "batch_size = 7"))
    result = run_script(repo_copy)
    assert result.returncode != 0
    assert "0003-gqa-kv-cache.patch does not apply" in result.stderr and "FAILED" in result.stderr


def test_a_wrong_wheel_hash_is_refused(repo_copy, tmp_path):
    fake = tmp_path / "medusa_llm-0.1-py3-none-any.whl"
    fake.write_bytes(b"not the wheel")
    env_result = subprocess.run(["bash", str(repo_copy / "apply_patches.sh")], capture_output=True, text=True,
                                env={"PATH": "/usr/bin:/bin", "MEDUSA_WHEEL": str(fake)})
    assert env_result.returncode != 0 and "expected" in env_result.stderr


def tiny_llama_medusa(directory: Path) -> tuple[LlamaForCausalLM, Path]:
    """A tiny Llama with GQA, rope_theta 5e5, explicit head_dim and biases, plus upstream-format heads."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=392, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_theta=5e5, attention_bias=True, initializer_range=0.1, eos_token_id=None,
                         bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config).float().eval()
    base = directory / "base"
    model.save_pretrained(base)
    write_tokenizer(base)
    heads = directory / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1,
                                                   "base_model_name_or_path": str(base)}))
    state = {}
    for i in range(4):
        state[f"{i}.0.linear.weight"] = torch.randn(64, 64) * 0.05
        state[f"{i}.0.linear.bias"] = torch.randn(64) * 0.05
        state[f"{i}.1.weight"] = model.lm_head.weight.detach() + torch.randn(392, 64) * 0.05
    torch.save(state, heads / "medusa_lm_head.pt")
    return model, heads


@pytest.mark.parametrize("choices", [mc_sim_7b_63, [1, 2, 2, 2, 2]], ids=["sparse_mc_sim_7b_63", "cartesian"])
def test_patched_upstream_medusa_generate_equals_hf_greedy(tmp_path, choices):
    model, heads = tiny_llama_medusa(tmp_path)
    medusa = upstream.MedusaModel.from_pretrained(str(heads), torch_dtype=torch.float32)
    prompt = [1, 5, 17, 99, 3, 250, 42]
    last = None
    for last in medusa.medusa_generate(torch.tensor([prompt]), temperature=0.0, max_steps=80,
                                       medusa_choices=choices, max_new_tokens=48):
        pass
    assert last["ids"] == hf_greedy(model, prompt, 48)


def test_upstream_stops_at_eos_inside_a_chunk(tmp_path):
    model, heads = tiny_llama_medusa(tmp_path)
    medusa = upstream.MedusaModel.from_pretrained(str(heads), torch_dtype=torch.float32)
    prompt = [1, 5, 17, 99, 3, 250, 42]
    reference = hf_greedy(model, prompt, 48)
    eos = reference[10]
    outputs = list(medusa.medusa_generate(torch.tensor([prompt]), max_steps=80, medusa_choices=mc_sim_7b_63,
                                          max_new_tokens=48, eos_token_id=eos))
    assert outputs[-1]["ids"] == reference[: reference.index(eos) + 1]


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "tree_16", "chain_3"])
def test_upstream_tree_buffers_agree_with_ours(tree):
    paths = load_tree(tree)
    theirs = upstream.generate_medusa_buffers(paths, device="cpu")
    ours = build_tree_buffers(paths)
    assert theirs["tree_indices"].tolist() == ours.tree_indices.tolist()
    assert theirs["medusa_position_ids"].tolist() == ours.position_offsets[0].tolist()
    assert theirs["medusa_attn_mask"][0, 0].bool().tolist() == ours.tree_mask.tolist()
    assert sorted(theirs["retrieve_indices"].tolist()) == sorted(ours.retrieve_indices.tolist())


def test_upstream_api_on_an_openpangu_medusa_directory_matches_our_engine(tiny_pangu, tmp_path):
    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=4)
    combined = tmp_path / "openpangu-medusa"
    shutil.copytree(directory, combined)
    save_heads(heads, combined, combined=True)
    served = upstream.MedusaModel.from_pretrained(str(combined), torch_dtype=torch.float32)
    assert isinstance(served, medusa_compat.OpenPanguMedusa)
    prompt = [1, 20, 31, 44, 9]
    last = None
    for last in served.medusa_generate(torch.tensor([prompt]), medusa_choices=mc_sim_7b_63, max_new_tokens=40):
        pass
    ours = MedusaModel(model, heads)
    expected = [t for s in ours.medusa_generate(prompt, max_new_tokens=40, tree=mc_sim_7b_63) for t in s]
    assert last["ids"] == expected == hf_greedy(model, prompt, 40)


@pytest.mark.parametrize("head_input,draft", [("hidden_and_next_token", False), ("hidden_and_path", False),
                                              ("hidden", True)])
def test_heads_upstream_cannot_read_are_served_by_our_engine_for_any_base(tmp_path, head_input, draft):
    model, upstream_heads = tiny_llama_medusa(tmp_path)
    heads = random_heads(model, num_heads=4, head_input=head_input, draft_vocab=upper_half_vocab(model) if draft else None)
    heads.config.base_model_name_or_path = json.loads((upstream_heads / "config.json").read_text())["base_model_name_or_path"]
    save_heads(heads, tmp_path / "our_heads")
    served = upstream.MedusaModel.from_pretrained(str(tmp_path / "our_heads"), torch_dtype=torch.float32)
    assert isinstance(served, medusa_compat.OpenPanguMedusa)
    prompt = [1, 5, 17, 99, 3, 250, 42]
    last = None
    for last in served.medusa_generate(torch.tensor([prompt]), medusa_choices=mc_sim_7b_63, max_new_tokens=40):
        pass
    assert last["ids"] == hf_greedy(model, prompt, 40)


def test_missing_vendored_copy_says_to_run_apply_patches(monkeypatch, tmp_path):
    monkeypatch.setattr(medusa_compat, "VENDORED", tmp_path / "nothing")
    with pytest.raises(medusa_compat.UpstreamMedusaMissing, match="bash apply_patches.sh"):
        medusa_compat.load_upstream()


def test_upstream_api_samples_losslessly_unless_typical_is_asked_for(tiny_pangu, tmp_path, monkeypatch):
    directory, model = tiny_pangu
    combined = tmp_path / "openpangu-medusa"
    shutil.copytree(directory, combined)
    save_heads(random_heads(model, num_heads=2), combined, combined=True)
    served = upstream.MedusaModel.from_pretrained(str(combined), torch_dtype=torch.float32)
    rules = []
    real_decode = served.model.decoder.decode
    monkeypatch.setattr(served.model.decoder, "decode",
                        lambda request, tree, acceptance, stats: rules.append(acceptance.rule) or real_decode(
                            request, tree, acceptance, stats))
    for acceptance in (None, "typical"):
        kwargs = {} if acceptance is None else {"acceptance": acceptance}
        list(served.medusa_generate(torch.tensor([[1, 20, 31]]), temperature=0.7, max_new_tokens=4, **kwargs))
    list(served.medusa_generate(torch.tensor([[1, 20, 31]]), temperature=0.0, max_new_tokens=4))
    assert rules == ["sample", "typical", "greedy"]
