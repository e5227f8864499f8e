"""The public API: a base causal LM plus Medusa heads, loaded and set up for the hardware at hand.

    model = MedusaModel.from_pretrained("/models/openPangu-Embedded-7B", "/models/heads", device="npu")
    out = model.generate(input_ids, max_new_tokens=256)          # transformers-style
    for step in model.medusa_generate(ids, max_new_tokens=256):  # each verification step's new ids
        ...

`from_pretrained` is the one place that decides which base, which heads, which tree and which dtype:
the command lines, `medusa_compat`, the benchmark and `convert_medusa` all load through it. The heads
themselves and their files are `inference.runtime.medusa_heads`; the decoding engine is `inference.engine`.
"""

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from inference.engine.decoding import DecodeRequest, DecodeStats, eos_ids
from inference.engine.medusa_decoding import Acceptance, MedusaDecoder, default_rule
from inference.engine.plain_decoding import PlainDecoder
from inference.engine.sampling import Sampling
from inference.engine.step_schedule import AdaptiveSchedule, StepOption
from inference.runtime.arguments import COMPILE_MODES, default_compile_mode
from inference.runtime.calibration import GraphProfile, graph_profile, step_profile, write_correction
from inference.runtime.demo_model import DEMO_NAME
from inference.runtime.devices import AUTO, as_device, as_dtype
from inference.runtime.console import to_stderr
from inference.runtime.home import use_compile_cache
from inference.runtime.loading import load_base, resolve_model_dir
from inference.runtime.medusa_heads import (  # noqa: F401  (the heads API, re-exported)
    COMBINED_CONFIG, HEAD_INPUTS, LAYOUTS, LAYOUTS_ON_DISK, ONE_CHECKPOINT_PREFIX, MedusaConfig, MedusaHeads,
    MedusaLoadError, has_base_weights, is_one_checkpoint, load_heads, read_medusa_config, save_heads, update_heads_config)
from inference.runtime.runtime_choice import (MIN_EXPECTED_SPEEDUP, RuntimeChoice, captured_alternatives, choose_runtime,
                                              redecided, with_graph_mode, with_step_options)
from inference.runtime.vllm_export import export_vllm
from medusa_choices import DynamicTree, Tree, load_tree, validate_tree

TREE_CHOICES = ("auto", "heads")
# Heads trained for the demo model by train/ (see its card); committed because they are small.
DEMO_HEADS_DIR = Path(__file__).resolve().parent / "train" / "demo_heads"
SAVE_LAYOUTS = LAYOUTS_ON_DISK + ("vllm",)


def default_tree(device_type: str, num_heads: int) -> Tree:
    """Small trees where tree tokens cost real time (CPU), upstream's 63-node tree on accelerators; only the
    levels the heads can fill."""
    name = "tree_8" if device_type == "cpu" else "mc_sim_7b_63"
    return [path for path in load_tree(name) if len(path) <= num_heads]


def resolve_sources(base_model: str | None, medusa: str | None) -> tuple[str | None, Path | None]:
    """(base model to load, None = the demo model; heads directory, None = none): the one rule for all entry points.

    - `medusa` given: those heads, on `base_model`, else on the base in the same directory (combined,
      one checkpoint) or the one their config names.
    - only `base_model`: heads inside it (a combined or one-checkpoint directory); a heads-only directory
      brings the base its config names; a plain model directory has no heads.
    - neither: the demo model with the committed demo heads.
    """
    if medusa is None and base_model is None:
        return None, DEMO_HEADS_DIR if (DEMO_HEADS_DIR / "config.json").is_file() else None
    heads_dir = resolve_model_dir(medusa or base_model)
    config = read_medusa_config(heads_dir)
    if config is None:
        if medusa is not None:
            raise MedusaLoadError(f"{heads_dir} holds no Medusa heads (config.json or {COMBINED_CONFIG} with medusa_num_heads)")
        return base_model, None
    if medusa is None or base_model is None:  # the base beside the heads, else the one their config names
        base_model = str(heads_dir) if has_base_weights(heads_dir) else config.base_model_name_or_path
    return (None if base_model in (None, DEMO_NAME) else base_model), heads_dir


def untrained_heads(base_model: nn.Module, num_heads: int = 4, num_layers: int = 1,
                    layout: str = "shared_lm_head") -> MedusaHeads:
    """Fresh heads (identity ResBlocks): correct output at about one token per step; a start for training."""
    c = base_model.config
    config = MedusaConfig(num_heads, num_layers, layout, c.hidden_size, c.vocab_size, getattr(c, "_name_or_path", None))
    heads = MedusaHeads(config, c.hidden_size, c.vocab_size)
    heads.init_from_lm_head(base_model.lm_head)
    return heads


def given_tree(tree: str | Tree | DynamicTree, heads: MedusaHeads, device_type: str) -> Tree | DynamicTree | None:
    """The tree a `tree` argument names, or None when "auto" may choose one (the heads record their accuracy).

    "heads": the tree saved with the heads, else the device's default. A tree deeper than the heads is
    an error wherever it comes from.
    """
    if tree == "auto" and heads.config.medusa_head_accuracy is not None:
        return None
    if isinstance(tree, list):
        chosen = validate_tree(tree, heads.num_heads)
    elif isinstance(tree, DynamicTree):
        chosen = tree.checked(heads.num_heads)
    elif tree in TREE_CHOICES:
        stored = heads.config.medusa_choices
        if stored is None and heads.config.medusa_head_input == "features":
            chosen = DynamicTree().checked(heads.num_heads)  # the feature drafter drafts dynamic trees only
        elif stored is None:
            chosen = default_tree(device_type, heads.num_heads)
        else:
            chosen = validate_tree(stored, heads.num_heads) if isinstance(stored, list) else load_tree(stored, heads.num_heads)
    else:
        chosen = load_tree(tree, heads.num_heads)
    heads.check_ranks(chosen)
    return chosen


def compile_mode(compile: str | bool | None) -> str:
    """"auto", "on" or "off" from the argument `compile` (True / False are on / off; None: the default)."""
    if compile is None:
        return default_compile_mode()
    if isinstance(compile, bool):
        return "on" if compile else "off"
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES} or a bool, not {compile!r}")
    return compile


def choose_for_hardware(model: nn.Module, heads: MedusaHeads, dtype: torch.dtype | None,
                        tree: Tree | DynamicTree | None, log: Callable[[str], None] = to_stderr,
                        compile: str = "off") -> RuntimeChoice:
    """Dtype, tree and graph mode for this machine (calibrated once, then cached); what is given is kept as given.

    `compile` auto: eager and captured steps of the chosen tree (chosen from eager costs, also where those put plain
    decoding ahead) are timed against each other in every dtype the choice may take, and each side runs in the dtype
    and graph mode timed fastest; plain decoding takes over where the faster plain step leaves an automatically chosen
    tree expected below the threshold. `compile` on: the same timing, but each side runs captured, in the dtype (and
    with the tree) whose captured steps were timed fastest; nothing is timed where dtype and tree are both given."""
    if dtype is not None and tree is not None:
        return captured_where_faster(RuntimeChoice.as_given(dtype, tree), model, heads, tree, [dtype], log, compile)[0]
    accuracy = heads.config.medusa_head_accuracy
    profile = step_profile(model, heads, None if dtype is None else [dtype], log)
    # where steps may be captured, the tree eager costs expect to do best is timed captured even where they put plain
    # decoding ahead: capturing sheds a per-op cost that weighs most on tree steps (the demo drafter's bf16 steps with
    # bf16 limited to AVX2: 5 tokens eager 3.8x a plain token, captured 2.1x; 3 tokens captured 1.5x, and 1.24x the
    # plain rate end to end), and `with_graph_mode` falls back to plain decoding where the captured timings leave it
    # below the threshold
    min_speedup = MIN_EXPECTED_SPEEDUP if compile == "off" else 0.0
    choice = choose_runtime(profile, heads.num_heads, accuracy, dtype, tree, dynamic=heads.propose_after_verification,
                            min_speedup=min_speedup)
    alternatives = captured_alternatives(choice, profile, accuracy, heads.num_heads) if tree is None else ()
    choice, graph = captured_where_faster(choice, model, heads, tree, list(profile.plain_ms), log, compile,
                                          alternatives)
    return with_step_options(choice, profile, accuracy, heads.num_heads, tree_given=tree is not None, graph=graph)


def captured_where_faster(choice: RuntimeChoice, model: nn.Module, heads: MedusaHeads, tree: Tree | DynamicTree | None,
                          dtypes: list[torch.dtype], log: Callable[[str], None], compile: str,
                          alternatives: tuple[StepOption, ...] = ()) -> tuple[RuntimeChoice, GraphProfile | None]:
    """`choice` with each side captured as `compile` says (auto: in the dtype of `dtypes` and the graph mode timed
    fastest, on: in the dtype timed fastest captured; either way with the tree among the chosen one and `alternatives`
    expected to give the most tokens per captured ms), and the eager against captured timings that decided it."""
    if compile == "off":
        return choice, None
    use_compile_cache()
    if compile == "on" and tree is not None and len(dtypes) == 1:  # nothing left to choose
        return replace(choice, compiled=True, plain_compiled=True), None
    graph = graph_profile(model, heads, choice.tree, dtypes, log, tuple(option.tree for option in alternatives))
    if compile == "on":
        graph = graph.captured_only()
    return with_graph_mode(choice, graph, may_fall_back=tree is None, alternatives=alternatives), graph


class MedusaModel(nn.Module):
    """A base causal LM plus Medusa heads. `tree` None means plain decoding: no tree is expected to be
    faster on this hardware (see `runtime.reason`)."""

    def __init__(self, base_model: nn.Module, heads: MedusaHeads, tokenizer=None,
                 tree: Tree | DynamicTree | None = None,
                 runtime: RuntimeChoice | None = None):
        """`tree` (default: the heads' saved one) or `runtime` (a choice that carries its tree), not both."""
        if tree is not None and runtime is not None:
            raise ValueError("give MedusaModel a tree or a runtime choice (which carries its tree), not both")
        super().__init__()
        self.base_model = base_model
        self.medusa_head = heads.to(device=base_model.device, dtype=base_model.dtype)
        self.tokenizer = tokenizer
        if runtime is None:
            runtime = RuntimeChoice.as_given(base_model.dtype, tree or given_tree("heads", heads, base_model.device.type))
        self.runtime = runtime
        self.tree = runtime.tree
        self.decoder = MedusaDecoder(base_model, self.medusa_head, runtime.compiled, log=to_stderr)
        # each step's choice checked against what steps really cost here, for as long as this model lives
        self.schedule = AdaptiveSchedule(list(runtime.options), runtime.options_timed,
                                         self._corrected if runtime.profile else None, to_stderr) \
            if runtime.options else None
        self.plain_decoder = PlainDecoder(base_model, runtime.plain_compiled, log=to_stderr)

    @property
    def config(self):
        return self.base_model.config

    def _corrected(self, costs: dict[int, float]) -> list[StepOption]:
        """Real steps timed `costs` (tokens per step -> ms): the profile corrected (and kept), the choice decided
        again from it; its options run from the next request."""
        profile = write_correction(self.runtime.profile, self.runtime.dtype, costs, log=to_stderr)
        self.runtime = redecided(self.runtime, profile, self.medusa_head.num_heads,
                                 self.medusa_head.config.medusa_head_accuracy)
        return list(self.runtime.options)

    @classmethod
    def untrained(cls, base_model: nn.Module, num_heads: int = 4, num_layers: int = 1,
                  layout: str = "shared_lm_head", tokenizer=None) -> "MedusaModel":
        return cls(base_model, untrained_heads(base_model, num_heads, num_layers, layout), tokenizer)

    @classmethod
    def from_pretrained(cls, base_model: str | None = None, medusa: str | None = None,
                        device: str | torch.device = "auto", dtype: str | torch.dtype | None = "auto",
                        tree: str | Tree | DynamicTree = "auto", compile: str | bool | None = None,
                        log: Callable[[str], None] = to_stderr) -> "MedusaModel":
        """Base and heads as `resolve_sources` finds them, in the dtype and tree that are fastest here.

        `device`: auto | cpu | cuda[:N] | npu[:N] or a torch.device. `dtype`: auto (the fastest here), checkpoint
        or None (the checkpoint's own), bf16 | fp16 | fp32 or a torch.dtype. `tree`: auto (chosen from the heads' measured accuracy and this
        machine's calibrated step costs; plain decoding when no tree is expected to pay), heads (the tree
        saved with the heads), a name from medusa_choices, a JSON file, a list of rank paths, or a DynamicTree
        (`dynamic[:N]`: N nodes chosen at every step from the heads' probabilities). `compile`: auto (each
        step captured as one graph where that was timed faster here), on / True, off / False; None:
        $OPENPANGU_MEDUSA_COMPILE, else auto.
        `log` receives the one-line notices (which heads, calibration, the choice).
        """
        torch_device, dtype = as_device(device), as_dtype(dtype)
        base_source, heads_dir = resolve_sources(base_model, medusa)
        model, tokenizer = load_base(base_source, torch_device, None if dtype == AUTO else dtype)
        if heads_dir is None:
            log("No Medusa heads given: using untrained heads (exact output, about 1 token per step).")
            heads = untrained_heads(model)
        else:
            heads = load_heads(heads_dir, model.config.hidden_size, model.config.vocab_size)
            draft = heads.config.medusa_draft_vocab_size
            proposing = f", proposing from {draft} tokens" if draft else ""
            if heads.config.medusa_head_input == "features":
                fusing = f", fusing the inputs of layers {list(heads.aux_layers)}" if heads.aux_layers else ""
                layers = len(heads.layers)
                log(f"Feature drafter: {heads_dir} ({layers} decoder layer{'s' if layers > 1 else ''}, "
                    f"{heads.num_heads} levels{proposing}{fusing})")
            else:
                log(f"Medusa heads: {heads_dir} ({heads.num_heads} heads, {heads.config.medusa_head_layout}, "
                    f"input {heads.config.medusa_head_input}{proposing})")
        runtime = choose_for_hardware(model, heads, None if dtype == AUTO else model.dtype,
                                      given_tree(tree, heads, torch_device.type), log, compile_mode(compile))
        return cls(model.to(runtime.dtype), heads, tokenizer, runtime=runtime)

    def save_pretrained(self, directory: str | os.PathLike, layout: str = "heads") -> None:
        """`heads`: heads only (config.json + medusa_lm_head.safetensors); `combined`: base files with the
        heads beside them; `one_checkpoint`: heads inside the model's safetensors, fields in its config.json;
        `vllm`: the heads as vLLM's Medusa speculator loads them (hidden-input heads only), a feature drafter as
        its EAGLE speculator does."""
        if layout not in SAVE_LAYOUTS:
            raise ValueError(f"layout must be one of {SAVE_LAYOUTS}")
        if layout == "heads":
            save_heads(self.medusa_head, directory)
            return
        if layout == "vllm":
            export_vllm(self.medusa_head, self.base_model.lm_head, directory, self.base_model.config)
            return
        if layout == "combined":
            self.base_model.save_pretrained(directory)
            save_heads(self.medusa_head, directory, combined=True)
        else:
            state = dict(self.base_model.state_dict())
            state.update({ONE_CHECKPOINT_PREFIX + k: v for k, v in self.medusa_head.state_dict().items()})
            self.base_model.save_pretrained(directory, state_dict=state)
            fields = self.medusa_head.config.to_dict()
            fields.pop("base_model_name_or_path", None)
            tree = str(self.tree) if isinstance(self.tree, DynamicTree) else self.tree
            update_heads_config(Path(directory) / "config.json", fields | {"medusa_choices": tree or fields.get("medusa_choices")})
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)

    def eos_token_ids(self, eos_token_id: int | list[int] | None = None) -> tuple[int, ...]:
        """The ids that end a reply: `eos_token_id` if given, else the model's and the tokenizer's."""
        if eos_token_id is not None:
            return eos_ids(eos_token_id)
        return eos_ids(self.base_model.generation_config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None))

    def decode(self, request: DecodeRequest, acceptance: Acceptance | None = None,
               stats: DecodeStats | None = None, tree: Tree | DynamicTree | None = None,
               scheduled: bool = True) -> Iterator[list[int]]:
        """Each step's new ids: Medusa with `tree` (default: the chosen one, each step checked against real steps
        unless `scheduled` is False), or plain decoding where none was chosen."""
        tree = tree or self.tree
        if tree is None:
            return self.plain_decoder.decode(request, stats)
        acceptance = acceptance or Acceptance(default_rule(request.sampling.temperature))
        schedule = self.schedule if tree is self.tree and scheduled else None
        return self.decoder.decode(request, schedule or tree, acceptance, stats)

    def medusa_generate(self, input_ids, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                        acceptance: str | None = None, posterior_threshold: float = 0.09,
                        posterior_alpha: float = 0.3, eos_token_id=None, seed: int | None = None, tree=None,
                        stats=None) -> Iterator[list[int]]:
        """Yield lists of new token ids, one list per verification step (batch size 1)."""
        ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise ValueError(f"Medusa decoding supports batch size 1, got {len(ids)} sequences")
            ids = ids[0]
        rule = acceptance or default_rule(temperature)
        request = DecodeRequest(ids, max_new_tokens, self.eos_token_ids(eos_token_id), Sampling(temperature, top_p), seed)
        return self.decode(request, Acceptance(rule, posterior_threshold, posterior_alpha), stats, tree)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, eos_token_id=None,
                 streamer=None, seed: int | None = None, **unsupported) -> torch.Tensor:
        """transformers-style `generate` with Medusa decoding underneath: returns prompt + new ids [1, L].

        Greedy (`do_sample=False`) equals HF greedy `generate`; sampling is lossless. Batch size 1;
        left padding in `attention_mask` is dropped. A `streamer` gets the prompt, then each step's ids.
        Other generation arguments are not supported and raise, rather than being ignored.
        """
        if unsupported:
            raise ValueError(f"MedusaModel.generate does not support {', '.join(sorted(unsupported))}")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"Medusa generate supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}")
        prompt = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]
        if streamer is not None:
            streamer.put(prompt.unsqueeze(0).cpu())
        new: list[int] = []
        for step in self.medusa_generate(prompt.tolist(), max_new_tokens=max_new_tokens,
                                         temperature=temperature if do_sample else 0.0, top_p=top_p if do_sample else 1.0,
                                         eos_token_id=eos_token_id, seed=seed):
            new.extend(step)
            if streamer is not None:
                streamer.put(torch.tensor(step))
        if streamer is not None:
            streamer.end()
        return torch.cat([prompt, torch.tensor(new, dtype=prompt.dtype, device=prompt.device)]).unsqueeze(0)
