"""Where this project keeps what it makes once and reuses: the converted demo model, the calibration profiles
and the compiled code of captured steps."""

import os
from pathlib import Path


def cache_home() -> Path:
    """`$OPENPANGU_MEDUSA_HOME`, default `~/.cache/openpangu-medusa`."""
    return Path(os.environ.get("OPENPANGU_MEDUSA_HOME", Path.home() / ".cache" / "openpangu-medusa"))


def use_compile_cache() -> Path:
    """Keep inductor's compiled graphs (FX-graph and AOT caches) under the home, so a second process reuses
    them; a TORCHINDUCTOR_CACHE_DIR the user set wins."""
    directory = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_home() / "inductor")))
    return directory
