"""Where this project keeps what it makes once and reuses: the converted demo model and the calibration profiles."""

import os
from pathlib import Path


def cache_home() -> Path:
    """`$OPENPANGU_MEDUSA_HOME`, default `~/.cache/openpangu-medusa`."""
    return Path(os.environ.get("OPENPANGU_MEDUSA_HOME", Path.home() / ".cache" / "openpangu-medusa"))
