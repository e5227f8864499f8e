"""Where this project keeps what it makes once and reuses: the converted demo model, the calibration profiles
and the compiled code of captured steps."""

import os
from pathlib import Path


def cache_home() -> Path:
    """`$OPENPANGU_MEDUSA_HOME`, default `~/.cache/openpangu-medusa`."""
    return Path(os.environ.get("OPENPANGU_MEDUSA_HOME", Path.home() / ".cache" / "openpangu-medusa"))


def use_compile_cache() -> Path:
    """Keep inductor's caches under the home; a TORCHINDUCTOR_CACHE_DIR the user set wins. With frozen weights
    inductor does not cache whole graphs, only the kernels it builds (a second process compiled the demo
    model's plain step in 38 s instead of 46). (Inductor writes its default into the variable the first
    time it looks, so that default is replaced too.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_home() / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
