"""Head files (both layouts, strict loading), tree validation and tree buffers."""

import json

import pytest
import torch

from inference.engine.decoding import DecodeRequest
from inference.engine.forward import visible_mask
from inference.engine.tree_buffers import build_tree_buffers
from medusa_choices import NAMED_TREES, TreeError, load_tree, validate_tree
from medusa_helpers import hf_greedy, random_heads, random_prompts, upper_half_vocab
from medusa_model import MedusaConfig, MedusaHeads, MedusaLoadError, MedusaModel, load_heads, save_heads


@pytest.mark.parametrize("layout,head_input,draft", [
    ("shared_lm_head", "hidden", False), ("own_lm_head", "hidden", False),
    ("shared_lm_head", "hidden_and_next_token", False), ("shared_lm_head", "hidden_and_next_token", True),
    ("shared_lm_head", "hidden_and_path", False), ("shared_lm_head", "hidden_and_path", True),
    ("own_lm_head", "hidden_and_path", False),
])
def test_heads_round_trip_in_every_layout(tiny_pangu, tmp_path, layout, head_input, draft):
    model = tiny_pangu[1]
    draft_vocab = upper_half_vocab(model) if draft else None
    heads = random_heads(model, num_heads=3, layout=layout, head_input=head_input, draft_vocab=draft_vocab)
    save_heads(heads, tmp_path)
    loaded = load_heads(tmp_path, model.config.hidden_size, model.config.vocab_size)
    assert (loaded.config.medusa_head_layout, loaded.config.medusa_head_input) == (layout, head_input)
    assert (loaded.draft_vocab.tolist() if draft else loaded.draft_vocab) == draft_vocab
    for key, value in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    hidden, token_embeds = torch.randn(2, model.config.hidden_size), torch.randn(2, 3, model.config.hidden_size)
    assert torch.equal(loaded(hidden, model.lm_head, token_embeds=token_embeds),
                       heads(hidden, model.lm_head, token_embeds=token_embeds))


@pytest.mark.parametrize("head_input", ["hidden_and_next_token", "hidden_and_path"])
def test_untrained_token_reading_heads_start_as_plain_heads(tiny_pangu, head_input):
    model = tiny_pangu[1]
    c = model.config
    plain = MedusaHeads(MedusaConfig(3, 1, "shared_lm_head"), c.hidden_size, c.vocab_size)
    reading = MedusaHeads(MedusaConfig(3, 1, "shared_lm_head", medusa_head_input=head_input), c.hidden_size, c.vocab_size)
    for i in range(3):
        reading[i][1].load_state_dict(plain[i][0].state_dict())
    hidden, token_embeds = torch.randn(4, c.hidden_size), torch.randn(4, 3, c.hidden_size)
    assert torch.allclose(reading(hidden, model.lm_head, token_embeds=token_embeds), plain(hidden, model.lm_head))
    with pytest.raises(ValueError, match="token_embeds"):
        reading(hidden, model.lm_head)


def test_sequential_head_i_reads_the_tokens_t1_to_t1_plus_i(tiny_pangu):
    model = tiny_pangu[1]
    c = model.config
    heads = random_heads(model, num_heads=3, head_input="hidden_and_path")
    assert heads.tokens_per_head == [1, 2, 3]
    hidden, token_embeds = torch.randn(4, c.hidden_size), torch.randn(4, 3, c.hidden_size)
    changed = token_embeds.clone()
    changed[:, 1] += 1  # token t+2: heads 1 and 2 read it, head 0 does not
    before, after = heads.states(hidden, token_embeds=token_embeds), heads.states(hidden, token_embeds=changed)
    assert torch.equal(before[0], after[0]) and not torch.allclose(before[1], after[1])
    with pytest.raises(ValueError, match="head 2 reads the 3 token"):
        heads.states(hidden, token_embeds=token_embeds[:, :2])


def test_own_lm_head_keys_follow_upstream_layout(tiny_pangu):
    model = tiny_pangu[1]
    keys = set(random_heads(model, num_heads=2, layout="own_lm_head").state_dict())
    assert keys == {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"}


def test_pt_heads_load_with_weights_only(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    heads = random_heads(model, num_heads=2, layout="own_lm_head")
    torch.save(heads.state_dict(), tmp_path / "medusa_lm_head.pt")
    # upstream configs carry no layout: own_lm_head is implied
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    loaded = load_heads(tmp_path, model.config.hidden_size, model.config.vocab_size)
    assert torch.equal(loaded[1][1].weight, heads[1][1].weight)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 32}, "hidden_size=32"),
    ({"vocab_size": 7}, "vocab_size=7"),
    ({"medusa_num_heads": 5}, "missing"),
    ({"medusa_head_layout": "own_lm_head"}, "missing"),
    ({"medusa_head_input": "hidden_and_next_token"}, "unexpected"),
    ({"medusa_head_input": "hidden_and_path"}, "unexpected"),
    ({"medusa_head_input": "tokens"}, "medusa_head_input must be one of"),
])
def test_mismatched_heads_are_a_clear_error(tiny_pangu, tmp_path, change, message):
    model = tiny_pangu[1]
    save_heads(random_heads(model, num_heads=3), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MedusaLoadError, match=message):
        load_heads(tmp_path, model.config.hidden_size, model.config.vocab_size)


def test_draft_vocabulary_needs_shared_lm_head_and_ids_inside_the_vocabulary(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    with pytest.raises(MedusaLoadError, match="needs shared_lm_head"):
        MedusaConfig(2, 1, "own_lm_head", medusa_draft_vocab_size=8)
    save_heads(random_heads(model, num_heads=2, draft_vocab=[3, model.config.vocab_size]), tmp_path)
    with pytest.raises(MedusaLoadError, match="outside the base vocabulary"):
        load_heads(tmp_path, model.config.hidden_size, model.config.vocab_size)


def test_heads_for_another_vocabulary_are_rejected_by_shape(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    c = model.config
    other = MedusaHeads(MedusaConfig(2, 1, "own_lm_head"), c.hidden_size, c.vocab_size + 1)
    save_heads(other, tmp_path)
    with pytest.raises(MedusaLoadError, match="shape"):
        load_heads(tmp_path, c.hidden_size, c.vocab_size)


def test_missing_head_weights_are_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(MedusaLoadError, match="no Medusa head weights"):
        load_heads(tmp_path, 8, 8)


def test_combined_directory_loads_base_and_heads(tiny_pangu, tmp_path):
    directory, model = tiny_pangu
    heads = random_heads(model, num_heads=4)
    MedusaModel(model, heads).save_pretrained(tmp_path / "combined", layout="combined")
    (tmp_path / "combined" / "tokenizer.model").write_bytes((directory / "tokenizer.model").read_bytes())
    (tmp_path / "combined" / "tokenizer_config.json").write_text((directory / "tokenizer_config.json").read_text())
    loaded = MedusaModel.from_pretrained(str(tmp_path / "combined"), device="cpu", dtype="fp32", tree=load_tree("tree_16"))
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    out = [t for s in loaded.medusa_generate(prompt, max_new_tokens=40, eos_token_id=()) for t in s]
    assert out == hf_greedy(model, prompt, 40)


def test_medusa_generate_rejects_batches(tiny_pangu):
    model = tiny_pangu[1]
    medusa = MedusaModel(model, random_heads(model))
    with pytest.raises(ValueError, match="batch size 1"):
        medusa.medusa_generate(torch.ones(2, 4, dtype=torch.long))


@pytest.mark.parametrize("tree,message", [
    ([[0], [1, 0, 0]], "prefix-closed"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]], "only 4 Medusa heads"),
    ([[0], [0]], "more than once"),
    ([[0], [-1]], "non-negative"),
    ([], "non-empty"),
])
def test_bad_trees_are_rejected(tree, message):
    with pytest.raises(TreeError, match=message):
        validate_tree(tree, num_heads=4)


def test_tree_deeper_than_heads_is_rejected_by_the_decoder(tiny_pangu):
    from inference.engine.medusa_decoding import MedusaDecoder

    model = tiny_pangu[1]
    decoder = MedusaDecoder(model, random_heads(model, num_heads=2))
    with pytest.raises(ValueError, match="2 heads"):
        next(decoder.decode(DecodeRequest([1, 2, 3], 4), load_tree("chain_3")))


def test_named_trees_are_valid_and_small_trees_have_the_advertised_size():
    for name, tree in NAMED_TREES.items():
        validate_tree(tree)
    assert [len(load_tree(n)) for n in ("tree_8", "tree_16", "tree_32")] == [8, 16, 32]
    assert len(load_tree("mc_sim_7b_63")) == 63 and max(map(len, load_tree("openpangu_3head"))) == 3


def test_tree_from_json_file(tmp_path):
    (tmp_path / "tree.json").write_text(json.dumps({"tree": [[0], [1], [0, 0]]}))
    assert load_tree(str(tmp_path / "tree.json")) == [[0], [1], [0, 0]]
    with pytest.raises(TreeError, match="unknown tree"):
        load_tree("no_such_tree")


def test_tree_buffers_describe_the_tree():
    buffers = build_tree_buffers([[0], [1], [0, 0], [0, 1]])
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1]; topk 2 -> [root, h0 top0, h0 top1, h1 top0, h1 top1]
    assert buffers.tree_indices.tolist() == [0, 1, 2, 3, 4]
    assert buffers.position_offsets.tolist() == [[0, 1, 1, 2, 2]]
    assert sorted(map(tuple, buffers.retrieve_indices.tolist())) == [(0, 1, 3), (0, 1, 4), (0, 2, -1)]
    assert buffers.tree_mask[4].tolist() == [True, True, False, False, True]
    visible = visible_mask(buffers.tree_mask, torch.tensor([3]), capacity=10)
    assert visible.shape == (5, 10)
    assert visible[:, :3].all() and not visible[:, 8:].any()  # the cached text; the unwritten slots
    assert visible[4, 3:8].tolist() == [True, True, False, False, True]
