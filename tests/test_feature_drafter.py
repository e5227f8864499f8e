"""The feature drafter (EAGLE-style): exact output, real drafting, its files and its export to vLLM's eagle layout."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.engine.decoding import DecodeRequest, DecodeStats
from inference.engine.feature_drafting import FeatureTreeDrafter
from inference.engine.medusa_decoding import MedusaDecoder
from inference.runtime.feature_drafter import FeatureDrafter, base_hidden, new_feature_drafter, start_from
from inference.runtime.drafter_config import MedusaConfig
from inference.runtime.medusa_heads import MedusaLoadError, load_heads, save_heads
from inference.runtime.vllm_export import VllmExportError, eagle_parameter_names, export_vllm
from medusa_choices import DynamicTree, TreeError, load_tree
from medusa_helpers import (ScriptedSchedule, fit_feature_drafter, hf_greedy, plain_greedy, random_heads,
                            random_prompts)
from train.feature_drafter_training import (DrafterLoss, base_features, causal_attention, collate, depth_accuracy,
                                            feature_samples)

NEW_TOKENS = 64
CHAIN = DynamicTree(4, top_k=1, expand=1, lookup=0)
TREES = {"dynamic:16:lookup=0": load_tree("dynamic:16:lookup=0"), "dynamic:16": load_tree("dynamic:16"), "chain": CHAIN}
# Tokens per step of the fitted drafter on its training prompts (2.1 / 2.9 / 2.0 measured with 60 steps of
# training): a drafter that reads the wrong features or positions, or misses the accepted text, drafts near 1.
MIN_TOKENS_PER_STEP = {"dynamic:16:lookup=0": 1.7, "dynamic:16": 2.3, "chain": 1.6}


@pytest.fixture(scope="module")
def tiny(tiny_pangu):
    model = tiny_pangu[1]
    prompts = random_prompts(model.config.vocab_size)
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return model, prompts, references


@pytest.fixture(scope="module")
def fitted(tiny):
    model, prompts, _ = tiny
    return fit_feature_drafter(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def fused(tiny):
    """A drafter that also reads the inputs of the tiny model's layers 1 and 3 for the text."""
    model, prompts, _ = tiny
    return fit_feature_drafter(model, prompts, NEW_TOKENS, aux_layers=(1, 3))


@pytest.fixture(scope="module")
def two_layers(tiny):
    """A drafter of two decoder layers, each with its own KV cache."""
    model, prompts, _ = tiny
    return fit_feature_drafter(model, prompts, NEW_TOKENS, layers=2)


def decode_ids(decoder, prompt, tree, stats=None, max_new_tokens=NEW_TOKENS):
    return [t for step in decoder.decode(DecodeRequest(prompt, max_new_tokens), tree, stats=stats) for t in step]


@pytest.mark.parametrize("name", TREES)
@pytest.mark.parametrize("design", ["fitted", "fused", "two_layers"])
def test_greedy_output_with_the_feature_drafter_equals_plain_greedy_and_it_drafts(tiny, design, name, request):
    model, prompts, references = tiny
    decoder, stats = MedusaDecoder(model, request.getfixturevalue(design)), DecodeStats()
    for prompt, reference in zip(prompts, references):
        assert decode_ids(decoder, prompt, TREES[name], stats) == reference
    assert stats.tokens_per_step >= MIN_TOKENS_PER_STEP[name], stats.tokens_per_step


def test_plain_steps_keep_the_drafters_cache_whole(tiny, fitted):
    """Plain steps between tree steps change nothing in the output, and the drafter, which reads what they wrote,
    drafts after them as well as without them."""
    model, prompts, references = tiny
    decoder = MedusaDecoder(model, fitted)
    tree = TREES["dynamic:16:lookup=0"]
    alone, mixed = DecodeStats(), DecodeStats()
    for prompt, reference in zip(prompts, references):
        assert decode_ids(decoder, prompt, tree, alone) == reference
        assert decode_ids(decoder, prompt, ScriptedSchedule([tree, None, tree]), mixed) == reference
    tree_steps = mixed.steps - mixed.step_sizes[1]
    tokens_in_tree_steps = mixed.new_tokens - len(prompts) - mixed.step_sizes[1]
    assert mixed.step_sizes[1] > 50 and tokens_in_tree_steps / tree_steps >= 0.9 * alone.tokens_per_step


def teacher_forced_chain(model, drafter, text: list[int], root_at: int) -> tuple[list[int], list[float]]:
    """The drafter's top-1 chain below the root `text[root_at]` and its path log-probabilities, the long way: one
    whole-sequence causal pass per level (as training reads text), over the base features of the text before the
    root and then the drafter's own predicted features, no cache, no tree mask."""
    embeddings, proposals = model.get_input_embeddings(), drafter.proposal_lm_head(model.lm_head)
    tokens, chain, scores, total = list(text[: root_at + 1]), [], [], 0.0
    with torch.no_grad():
        features = drafter.text_features(*base_hidden(model, torch.tensor([tokens]), drafter.aux_layers))[0, :root_at]
        for _ in range(drafter.num_heads):
            cos, sin = (t[0] for t in model.model.rotary_emb(features, torch.arange(len(features)).unsqueeze(0)))
            predicted = drafter(embeddings(torch.tensor(tokens[1:])), features, cos, sin, causal_attention)[-1]
            log_probs = proposals(predicted).float().log_softmax(-1)
            best = int(log_probs.argmax())
            total += float(log_probs[best])
            token = int(drafter.token_ids(torch.tensor(best)))
            tokens, chain, scores = tokens + [token], chain + [token], scores + [total]
            features = torch.cat([features, predicted.unsqueeze(0)])
    return chain, scores


@pytest.mark.parametrize("design", ["fitted", "fused", "two_layers"])
def test_every_draft_is_the_chain_that_teacher_forcing_over_the_accepted_text_gives(tiny, design, request,
                                                                                  monkeypatch):
    """After the prompt, each verification and each plain step, the drafter's cache holds what reading the accepted
    text afresh gives, and its draft slots what reading its own chain does: the right features (fused ones
    included), tokens and positions, whatever acceptance the drafter reaches on this model."""
    model, prompts, _ = tiny
    fitted = request.getfixturevalue(design)
    drafted = []
    score = FeatureTreeDrafter.score

    def recording(self, state, length):
        candidates = score(self, state, length)
        drafted.append((int(length), candidates.tokens.tolist(), candidates.scores.tolist()))
        return candidates

    monkeypatch.setattr(FeatureTreeDrafter, "score", recording)
    decoder = MedusaDecoder(model, fitted)
    for prompt in prompts[:2]:
        text = prompt + hf_greedy(model, prompt, NEW_TOKENS + 8)
        drafted.clear()
        assert decode_ids(decoder, prompt, ScriptedSchedule([CHAIN, None, CHAIN])) == text[len(prompt):][:NEW_TOKENS]
        assert len({length for length, *_ in drafted}) > 10
        for root_at, chain, scores in drafted:
            expected_chain, expected_scores = teacher_forced_chain(model, fitted, text, root_at)
            assert chain == expected_chain, root_at
            assert scores == pytest.approx(expected_scores, abs=1e-4), root_at


def test_trees_of_other_sizes_share_the_drafters_candidates(tiny, fitted):
    model, prompts, references = tiny
    decoder = MedusaDecoder(model, fitted)
    schedule = ScriptedSchedule([load_tree("dynamic:16"), load_tree("dynamic:6"), None, load_tree("dynamic:24:lookup=0")])
    for prompt, reference in zip(prompts, references):
        assert decode_ids(decoder, prompt, schedule) == reference


def test_a_tree_with_levels_drafts_that_many_levels_of_the_feature_drafter(tiny, fitted):
    model, prompts, references = tiny
    decoder, stats, tree = MedusaDecoder(model, fitted), DecodeStats(), load_tree("dynamic:16:lookup=0:levels=2")
    for prompt, reference in zip(prompts, references):
        assert decode_ids(decoder, prompt, tree, stats) == reference
    drafter = decoder.drafter(tree)
    with torch.inference_mode():
        candidates = drafter.score(drafter.cache.state, torch.tensor([len(prompts[-1])]))
    assert candidates.depths.max().item() == 2 and len(candidates.tokens) == tree.candidates(2)
    assert stats.tokens_per_step >= MIN_TOKENS_PER_STEP["chain"], stats.tokens_per_step


def test_the_feature_drafter_refuses_a_fixed_tree(tiny_pangu):
    model = tiny_pangu[1]
    decoder = MedusaDecoder(model, random_heads(model, head_input="features"))
    with pytest.raises(TreeError, match="dynamic tree"):
        decode_ids(decoder, [1, 2, 3], load_tree("chain_4"))


def test_training_moves_the_drafter_towards_the_base_model(tiny, fitted):
    model, prompts, _ = tiny
    samples = [{"prompt_ids": p, "output_ids": r} for p, r in zip(prompts, tiny[2])]
    features = base_features(model, samples, 4096)
    untrained = random_heads(model, num_heads=4, std=0.02, head_input="features")
    trained_accuracy = depth_accuracy(fitted, model, features, 4, ranks=1)
    untrained_accuracy = depth_accuracy(untrained, model, features, 4, ranks=1)
    assert trained_accuracy[0][0] > 0.3 > untrained_accuracy[0][0]
    with torch.no_grad():
        batch = collate(features, model)
        assert DrafterLoss(fitted, model)(*batch)[0] < DrafterLoss(untrained, model)(*batch)[0]
        online = collate(feature_samples(samples, 4096), model)  # features computed in the step: the same batch
        assert batch[3] is None is online[3]
        assert all(torch.allclose(a.float(), b.float(), atol=1e-5) for a, b in zip(batch[:3], online[:3]))


def test_a_fused_drafter_starts_as_the_plain_one_and_learns_to_read_the_intermediate_layers(tiny, fused):
    model, prompts, references = tiny
    samples = [{"prompt_ids": p, "output_ids": r} for p, r in zip(prompts, references)]
    features = base_features(model, samples, 4096, aux_layers=(1, 3))
    with torch.no_grad():
        hidden, aux = base_hidden(model, features[0].ids.unsqueeze(0), (1, 3))
        assert torch.equal(features[0].aux, aux[0]) and aux.shape[-1] == 2 * model.config.hidden_size
        untrained = new_feature_drafter(model, 4, aux_layers=[1, 3])
        assert torch.equal(untrained.text_features(hidden, aux), hidden)  # fuse starts at zero
        assert not torch.allclose(fused.text_features(hidden, aux), hidden, atol=1e-3)
        online = collate(feature_samples(samples, 4096), model, (1, 3))
        assert torch.allclose(collate(features, model, (1, 3))[3], online[3], atol=1e-5)


@pytest.mark.parametrize("aux_layers", [None, [1, 3]])
def test_a_saved_drafter_loads_as_it_was_and_strictly(tiny_pangu, tmp_path, aux_layers):
    model = tiny_pangu[1]
    c = model.config
    drafter = random_heads(model, num_heads=3, head_input="features", draft_vocab=list(range(100, 200)),
                           aux_layers=aux_layers)
    save_heads(drafter, tmp_path / "drafter")
    loaded = load_heads(tmp_path / "drafter", c.hidden_size, c.vocab_size)
    assert isinstance(loaded, FeatureDrafter) and loaded.num_heads == 3 and loaded.aux_layers == tuple(aux_layers or ())
    assert drafter.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))
    weights = load_file(str(tmp_path / "drafter" / "medusa_lm_head.safetensors"))
    del weights["fc.weight"]
    save_file(weights, str(tmp_path / "drafter" / "medusa_lm_head.safetensors"))
    with pytest.raises(MedusaLoadError, match="fc.weight"):
        load_heads(tmp_path / "drafter", c.hidden_size, c.vocab_size)


def test_the_eagle_export_holds_exactly_what_vllm_loads(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    drafter = random_heads(model, num_heads=3, head_input="features", draft_vocab=list(range(100, 200)))
    export_vllm(drafter, model.lm_head, tmp_path / "eagle", model.config)
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["attention_bias"] is True and config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    names = set(load_file(str(tmp_path / "eagle" / "model.safetensors")))
    assert names == eagle_parameter_names(config) and "layers.0.self_attn.o_proj.bias" in names
    drafter.layers[0].self_attn.o_proj.bias = None  # a layer vLLM would find without the bias it expects
    with pytest.raises(VllmExportError, match="o_proj.bias"):
        export_vllm(drafter, model.lm_head, tmp_path / "broken", model.config)


def test_layers_added_to_a_drafter_start_as_identities_and_export_with_their_input_norms(tiny, fitted, tmp_path):
    model, prompts, _ = tiny
    grown = new_feature_drafter(model, fitted.num_heads, layers=2).to(model.dtype)
    start_from(grown, fitted)
    text = prompts[0] + plain_greedy(model, prompts[0], 8)
    root = len(text) - 1
    assert teacher_forced_chain(model, grown, text, root) == teacher_forced_chain(model, fitted, text, root)
    with pytest.raises(MedusaLoadError, match="of 1 layers cannot start from one of 2"):
        start_from(fitted, grown)
    export_vllm(grown, model.lm_head, tmp_path / "eagle", model.config)
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    names = set(load_file(str(tmp_path / "eagle" / "model.safetensors")))
    assert config["num_hidden_layers"] == 2 and names == eagle_parameter_names(config)
    assert "layers.1.input_layernorm.weight" in names and "layers.0.input_layernorm.weight" not in names


def test_a_fused_drafter_is_refused_where_it_cannot_run(tiny_pangu, tmp_path):
    model = tiny_pangu[1]
    drafter = random_heads(model, num_heads=3, head_input="features", aux_layers=[1, 3])
    with pytest.raises(VllmExportError, match="fused feature drafter .* no vLLM layout"):
        export_vllm(drafter, model.lm_head, tmp_path / "eagle", model.config)
    beyond = random_heads(model, num_heads=3, head_input="features", aux_layers=[model.config.num_hidden_layers])
    with pytest.raises(ValueError, match="fuses layers \\[4\\], but the base model has 4"):
        MedusaDecoder(model, beyond)


@pytest.mark.parametrize("fields", [{"medusa_feature_aux_layers": [1]},
                                    {"medusa_head_input": "features", "medusa_feature_aux_layers": [0]},
                                    {"medusa_head_input": "features", "medusa_feature_aux_layers": [3, 1]}])
def test_aux_layers_belong_to_a_feature_drafter_and_name_layers(tiny_pangu, fields):
    config = random_heads(tiny_pangu[1], num_heads=2, head_input="features").config.to_dict()
    if "medusa_head_input" not in fields:
        config = {k: v for k, v in config.items() if k not in ("medusa_head_input", "medusa_feature_layer")}
    with pytest.raises(MedusaLoadError, match="medusa_feature_aux_layers"):
        MedusaConfig.from_dict(config | fields)
