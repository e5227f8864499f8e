"""Run upstream FasterDecoding Medusa's own API with OpenPangu.

`bash apply_patches.sh` vendors the pinned upstream release into third_party/Medusa and patches it for
transformers 5, modern Llama configs (rope_theta, GQA, head_dim, biases), devices and sparse trees.
`import medusa_compat` then makes that copy importable as `medusa` and registers OpenPangu:

    import medusa_compat
    from medusa.model.medusa_model import MedusaModel
    model = MedusaModel.from_pretrained("<OpenPangu-Medusa dir>")
    for out in model.medusa_generate(input_ids, temperature=0.0, max_steps=512): ...

Routing: a directory whose base model is OpenPangu-Embedded (a combined directory, or heads whose
`base_model_name_or_path` is one), or whose heads read token t+1 (which upstream cannot run), is served
by THIS project's engine (medusa_model.MedusaModel: stock transformers forward, every head layout,
lossless acceptance) behind upstream's interface. Every other model goes through upstream's own
(patched) code unchanged.
"""

import hashlib
import json
import sys
from pathlib import Path

import openpangu_model  # noqa: F401  (registers PanguEmbedded with the Auto classes)
from inference.runtime.medusa_heads import read_medusa_config
from medusa_model import MedusaModel, resolve_sources

VENDORED = Path(__file__).resolve().parent / "third_party" / "Medusa"
CHECKSUMS = Path(__file__).resolve().parent / "patches" / "SHA256SUMS"


class UpstreamMedusaMissing(ImportError):
    pass


def _check_vendored() -> None:
    if not (VENDORED / "medusa" / "model" / "medusa_model.py").is_file():
        raise UpstreamMedusaMissing("upstream Medusa is not vendored: run `bash apply_patches.sh`")
    for line in CHECKSUMS.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        path = VENDORED / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise UpstreamMedusaMissing(
                f"third_party/Medusa/{name} is not the patched version: run `bash apply_patches.sh` "
                "(or `bash apply_patches.sh --revert` first if it was edited)"
            )


def _served_here(directory: Path) -> bool:
    """OpenPangu bases and heads upstream cannot read (token inputs, draft vocabulary) go to this
    project's engine; the rest to upstream's. The base is found as MedusaModel.from_pretrained finds it."""
    base, heads_dir = resolve_sources(str(directory), None)
    config = read_medusa_config(heads_dir) if heads_dir is not None else None
    if config is not None and (config.medusa_head_input != "hidden" or config.medusa_draft_vocab_size is not None):
        return True
    base_config = Path(base) / "config.json" if base is not None else None
    return base_config is not None and base_config.is_file() and \
        json.loads(base_config.read_text()).get("model_type") == "PanguEmbedded"


class OpenPanguMedusa:
    """Upstream's MedusaModel interface over this project's engine."""

    def __init__(self, model):
        self.model = model
        self.base_model = model.base_model
        self.tokenizer = model.tokenizer
        self.medusa = model.medusa_head.num_heads

    def get_tokenizer(self):
        return self.tokenizer

    def medusa_generate(self, input_ids, attention_mask=None, temperature=0.0, max_steps=512, medusa_choices=None,
                        posterior_threshold=0.09, posterior_alpha=0.3, max_new_tokens=None, eos_token_id=None,
                        acceptance=None):
        """Yields {"text", "ids"} after every step, as patched upstream does (batch size 1).

        Greedy at temperature 0; above it, lossless sampling (`acceptance="sample"`) unless upstream's lossy
        typical acceptance is asked for with `acceptance="typical"` (posterior_threshold, posterior_alpha)."""
        tree = None
        if medusa_choices is not None:
            if not isinstance(medusa_choices[0], (list, tuple)):
                raise ValueError("OpenPangu Medusa takes sparse trees (lists of rank paths), e.g. mc_sim_7b_63")
            tree = [list(p) for p in medusa_choices]
        ids: list[int] = []
        steps = self.model.medusa_generate(
            input_ids, max_new_tokens=max_new_tokens or max_steps * (self.medusa + 1), temperature=temperature,
            acceptance=acceptance, posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha,
            eos_token_id=eos_token_id, tree=tree,
        )
        for _, step in zip(range(max_steps + 1), steps):
            ids.extend(step)
            yield {"text": self.tokenizer.decode(ids, skip_special_tokens=True), "ids": list(ids)}


def register_openpangu(upstream_model_class) -> None:
    """Route OpenPangu directories given to upstream's MedusaModel.from_pretrained to our engine."""
    original = upstream_model_class.from_pretrained.__func__
    if getattr(original, "_openpangu_routed", False):
        return

    def from_pretrained(cls, medusa_head_name_or_path, **kwargs):
        directory = Path(medusa_head_name_or_path)
        if directory.is_dir() and _served_here(directory):
            dtype = kwargs.get("torch_dtype") or kwargs.get("dtype") or "auto"  # upstream passes torch dtypes
            model = MedusaModel.from_pretrained(str(directory), device=kwargs.get("device", "auto"), dtype=dtype,
                                                compile=kwargs.get("compile"))
            return OpenPanguMedusa(model)
        return original(cls, medusa_head_name_or_path, **kwargs)

    from_pretrained._openpangu_routed = True
    upstream_model_class.from_pretrained = classmethod(from_pretrained)


def load_upstream():
    """Import the vendored, patched upstream `medusa` package and register OpenPangu with it."""
    _check_vendored()
    if str(VENDORED) not in sys.path:
        sys.path.insert(0, str(VENDORED))
    import medusa.model.medusa_model as upstream

    register_openpangu(upstream.MedusaModel)
    return upstream


load_upstream()
