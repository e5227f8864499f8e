"""One rule for which base, heads, tree, dtype and EOS a Medusa model gets, in the library and the CLI alike."""

import json

import pytest
import torch

import medusa_model
from inference import medusa_generate
from inference.engine.decoding import DecodeRequest, eos_ids
from inference.runtime.calibration import StepProfile
from inference.runtime.medusa_heads import COMBINED_CONFIG, heads_config_path
from medusa_choices import TreeError, load_tree
from medusa_helpers import plain_greedy, random_heads, random_prompts
from medusa_model import MedusaLoadError, MedusaModel, load_heads, save_heads


@pytest.fixture
def heads_naming_their_base(tiny_pangu, tmp_path):
    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=2)
    heads.config.base_model_name_or_path = str(directory)
    save_heads(heads, tmp_path / "heads")
    return tmp_path / "heads"


def test_a_heads_directory_brings_its_base_in_the_library(tiny_pangu, heads_naming_their_base):
    for args in ((str(heads_naming_their_base),), (None, str(heads_naming_their_base))):
        loaded = MedusaModel.from_pretrained(*args, device="cpu", dtype="fp32", tree="chain_2")
        assert loaded.config.hidden_size == tiny_pangu[1].config.hidden_size and loaded.medusa_head.num_heads == 2


@pytest.mark.parametrize("flags", [["--base_model", "{heads}"], ["--medusa_dir", "{heads}"]])
def test_a_heads_directory_brings_its_base_in_the_cli(tiny_pangu, heads_naming_their_base, capsys, flags):
    flags = [f.format(heads=heads_naming_their_base) for f in flags]
    assert medusa_generate.main(flags + ["--prompt", "hi", "--max_new_tokens", "4", "--dtype", "fp32",
                                         "--medusa_choices", "chain_2", "--json"]) == 0
    out = capsys.readouterr()
    assert f"Model: {tiny_pangu[0]}" in out.err and json.loads(out.out.splitlines()[-1])["new_tokens"] == 4


def test_a_plain_model_directory_as_heads_is_a_clear_error(tiny_pangu):
    with pytest.raises(MedusaLoadError, match="holds no Medusa heads"):
        MedusaModel.from_pretrained(str(tiny_pangu[0]), str(tiny_pangu[0]), device="cpu", dtype="fp32")


def test_a_tree_deeper_than_the_heads_is_an_error_wherever_it_comes_from(tiny_pangu, tmp_path):
    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=2)
    heads.config.medusa_choices = load_tree("chain_3")
    heads.config.base_model_name_or_path = str(directory)
    save_heads(heads, tmp_path)
    with pytest.raises(TreeError, match="only 2 Medusa heads"):
        MedusaModel(model, heads)
    for tree in ("heads", "auto", "chain_3", load_tree("chain_3")):
        with pytest.raises(TreeError, match="only 2 Medusa heads"):
            MedusaModel.from_pretrained(str(tmp_path), device="cpu", dtype="fp32", tree=tree)


def test_auto_without_measured_accuracy_uses_the_heads_tree_and_calibrates_only_the_dtype(
        tiny_pangu, heads_naming_their_base, monkeypatch):
    profiles = []

    def fake_profile(model, heads, dtypes, log):
        profiles.append(dtypes)
        return StepProfile({torch.bfloat16: 10.0, torch.float32: 20.0},
                           {torch.bfloat16: {2: 30.0, 3: 40.0}, torch.float32: {2: 21.0, 3: 22.0}})

    monkeypatch.setattr(medusa_model, "step_profile", fake_profile)
    loaded = MedusaModel.from_pretrained(str(heads_naming_their_base), device="cpu", tree="auto")
    assert profiles == [None] and loaded.tree == [p for p in load_tree("tree_8") if len(p) <= 2]  # levels 2 heads fill
    assert loaded.runtime.dtype == torch.float32 and loaded.base_model.dtype == torch.float32
    assert MedusaModel.from_pretrained(str(heads_naming_their_base), device="cpu", dtype="fp32").tree is not None
    assert profiles == [None]  # dtype and tree both given: nothing to measure


def test_medusa_falls_back_to_plain_decoding_where_no_tree_pays(tiny_pangu, tmp_path, monkeypatch):
    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=2)
    heads.config.base_model_name_or_path = str(directory)
    heads.config.medusa_head_accuracy = [[0.3, 0.1], [0.2, 0.1]]
    save_heads(heads, tmp_path)
    # Issue 12's AVX2 CPU in miniature: a bf16 tree step costs ~k tokens, fp32 is flat but slower than plain bf16.
    avx2 = StepProfile({torch.bfloat16: 47.0, torch.float32: 87.0},
                       {torch.bfloat16: {2: 63.0, 5: 110.0}, torch.float32: {2: 95.0, 5: 100.0}},
                       "AMD EPYC (AVX2, no native bf16)")
    monkeypatch.setattr(medusa_model, "step_profile", lambda *args: avx2)
    loaded = MedusaModel.from_pretrained(str(tmp_path), device="cpu")
    assert loaded.tree is None and loaded.runtime.dtype == torch.bfloat16 and loaded.base_model.dtype == torch.bfloat16
    assert "plain decoding in bf16" in loaded.runtime.reason
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    steps = list(loaded.decode(DecodeRequest(prompt, 12)))
    assert [len(s) for s in steps] == [1] * 12
    assert [t for s in steps for t in s] == plain_greedy(loaded.base_model, prompt, 12)


def test_generate_rejects_arguments_it_does_not_support(tiny_pangu):
    medusa = MedusaModel(tiny_pangu[1], random_heads(tiny_pangu[1], num_heads=2))
    with pytest.raises(ValueError, match="num_beams"):
        medusa.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, num_beams=4)


def test_eos_is_a_set_of_ids_from_any_mix_of_ids_lists_and_none(tiny_pangu):
    assert eos_ids(7, [3, 7], None, (9,)) == (3, 7, 9) and eos_ids(None) == ()
    model = tiny_pangu[1]
    medusa = MedusaModel(model, random_heads(model, num_heads=2))
    previous = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [5, 8]
    try:
        assert medusa.eos_token_ids() == (5, 8) and medusa.eos_token_ids(3) == (3,)
    finally:
        model.generation_config.eos_token_id = previous


def test_a_draft_vocabulary_with_a_repeated_token_is_refused(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    save_heads(random_heads(model, num_heads=2, draft_vocab=[3, 4, 5, 3]), tmp_path)
    with pytest.raises(MedusaLoadError, match="more than once"):
        load_heads(tmp_path, model.config.hidden_size, model.config.vocab_size)


def test_the_heads_config_of_a_combined_directory_is_its_medusa_config(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    save_heads(random_heads(model, num_heads=2), tmp_path / "heads")
    MedusaModel(model, random_heads(model, num_heads=2)).save_pretrained(tmp_path / "combined", layout="combined")
    assert heads_config_path(tmp_path / "heads") == tmp_path / "heads" / "config.json"
    assert heads_config_path(tmp_path / "combined") == tmp_path / "combined" / COMBINED_CONFIG


def test_a_medusa_model_takes_a_tree_or_a_runtime_choice_not_both(tiny_pangu):
    from inference.runtime.runtime_choice import RuntimeChoice
    from medusa_choices import load_tree

    model = tiny_pangu[1]
    runtime = RuntimeChoice.as_given(torch.float32, load_tree("chain_2"))
    assert MedusaModel(model, random_heads(model, num_heads=2), runtime=runtime).tree == load_tree("chain_2")
    with pytest.raises(ValueError, match="not both"):
        MedusaModel(model, random_heads(model, num_heads=2), tree=load_tree("tree_8"), runtime=runtime)
