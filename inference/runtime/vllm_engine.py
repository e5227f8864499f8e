"""A real vLLM in this process, for the scripts that run inside `.venv-vllm` (`make vllm-setup`).

vLLM's engine core runs in the calling process (no multiprocessing), so OpenPangu's config class, registered
here with transformers before vLLM starts, is the one vLLM reads; its CPU KV cache gets `kv_cache_gib` unless
the environment says otherwise.
"""

import json
import os
from pathlib import Path


def start_vllm(model: str, kv_cache_gib: int, **llm_arguments):
    """vLLM's `LLM` for the base model directory `model`, token ids in and out (no tokenizer)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if json.loads((Path(model) / "config.json").read_text()).get("model_type") == "PanguEmbedded":
        import openpangu_model  # noqa: F401  (registers the PanguEmbedded config with transformers)
    from vllm import LLM

    return LLM(model=model, skip_tokenizer_init=True, seed=0, **llm_arguments)
