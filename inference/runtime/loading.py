"""Loading a base model and tokenizer from a local directory or a Hub repo, with clear errors."""

import json
import re
import sys
from pathlib import Path

import torch

import openpangu_model  # noqa: F401  (registers PanguEmbedded with the Auto classes)
from inference.engine.cpu_linear import use_packed_bf16_linears
from inference.runtime.demo_model import DEMO_NAME, prepare_demo_model
from inference.runtime.devices import parse_dtype, resolve_device, set_threads
from inference.runtime.errors import UserError
from inference.runtime.medusa_heads import is_one_checkpoint

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model_dir(name_or_path: str) -> Path:
    """A local directory as is; `org/name` through the Hub cache (offline: a clear message)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{path} is a file; a model directory was expected")
        if not any(path.iterdir()):
            raise UserError(f"{path} is empty: it holds no model files")
        return path
    if not HUB_ID.match(name_or_path):
        raise UserError(f"{name_or_path} does not exist (and is not a Hub repo id of the form org/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(name_or_path))
    except Exception as error:
        raise UserError(
            f"could not fetch {name_or_path} from the Hugging Face Hub ({type(error).__name__}); "
            "check the network or HF_ENDPOINT, or download it and pass the local directory"
        ) from None


def _check_causal_lm(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} has no config.json: not a transformers model directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{config_path} is not valid JSON: {error}") from None
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        parsed = AutoConfig.from_pretrained(directory)
    except Exception as error:
        raise UserError(f"{config_path} cannot be read as a model config: {error}") from None
    if type(parsed) not in AutoModelForCausalLM._model_mapping:
        raise UserError(f"{directory} holds a {config.get('model_type')!r} model, not a causal language model")
    return config


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as error:
        raise UserError(f"cannot load the tokenizer from {directory}: {type(error).__name__}: {error}") from None


def load_causal_lm(directory: Path, device: torch.device, dtype: torch.dtype | None):
    """The base model in eval mode on `device`, in `dtype` (None: the checkpoint's own); a truncated or
    corrupt weights file is a clear error.

    `directory` must hold a causal-LM config (load_base checks that before loading the tokenizer)."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    if is_one_checkpoint(directory):
        hf_logging.set_verbosity_error()  # the medusa_head.* keys are the heads, loaded by medusa_model
    try:
        model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or "auto", output_loading_info=True)
    except Exception as error:
        raise UserError(f"cannot load the model weights from {directory}: {type(error).__name__}: {error}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise UserError(f"{directory} lacks {len(missing)} weight(s), e.g. {missing[:3]}: incomplete checkpoint")
    model = model.to(device).eval()
    if device.type == "cpu":
        use_packed_bf16_linears(model)
    return model


def base_directory(base_model: str | None) -> tuple[Path, str]:
    """(directory, display name) of a causal LM; no `base_model` means the embedded demo model."""
    if base_model is None:
        directory, name = prepare_demo_model(), f"{DEMO_NAME} (embedded demo model)"
    else:
        directory, name = resolve_model_dir(base_model), base_model
    _check_causal_lm(directory)
    return directory, name


def load_base(base_model: str | None, device: torch.device, dtype: torch.dtype | None):
    """(model, tokenizer); no `base_model` means the embedded demo model, no `dtype` the checkpoint's own."""
    directory, name = base_directory(base_model)
    tokenizer = load_tokenizer(directory)
    model = load_causal_lm(directory, device, dtype)
    print(f"Model: {name} | device {device} | loaded in {str(model.dtype).removeprefix('torch.')}", file=sys.stderr)
    return model, tokenizer


def is_pangu(model) -> bool:
    return getattr(model.config, "model_type", "") == "PanguEmbedded"


def load_base_from_args(args):
    """(model, tokenizer) from the flags of `add_model_args` without auto (training and the tree builder)."""
    set_threads(args.threads)
    return load_base(args.base_model, resolve_device(args.device), parse_dtype(args.dtype))
