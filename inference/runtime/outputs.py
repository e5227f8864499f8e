"""Writing results without losing them: `--out` checked before the work, files replaced atomically, one
writer at a time.

A command that computes for minutes must not find out at the end that its output path cannot be written,
and an interrupted write must leave the old file whole: every file here is written to a staging file in
the same directory and renamed over the target (a rename is atomic on POSIX file systems).
"""

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from inference.runtime.errors import UserError


def check_writable(path: Path, what: str) -> None:
    """The nearest existing directory at or above `path` must let this process create entries."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{what}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what}: {existing} is not writable")


def check_output_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`path` as a file this process can create or replace (its directory created if missing); else one
    clear error, before any work."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; a file name was expected")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path} is not writable")
    check_writable(path.parent, f"{flag} {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def holds_base_model(directory: Path) -> bool:
    """A transformers model directory: its config.json names a model type (heads configs do not)."""
    config = directory / "config.json"
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        return True  # unreadable: not ours to replace


def check_output_dir(path: str | os.PathLike, force: bool = False, flag: str = "--out") -> Path:
    """`path` as a directory this process can create or write into: never a file, and never a base model's
    directory (whose config.json a heads or model layout would replace) unless `force`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; a directory was expected")
    if path.is_dir() and not force and holds_base_model(path):
        raise UserError(f"{flag} {path} holds a base model, whose config.json this would replace: "
                        "write elsewhere, or pass --force")
    check_writable(path, f"{flag} {path}")
    return path


def replace_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Replace `path` by what `write(staging_path)` writes, so that a reader (or a kill) sees the old file or
    the new one, never a part."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write(staging)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    replace_atomic(path, lambda staging: staging.write_text(text, encoding="utf-8"))


@contextmanager
def exclusive(path: str | os.PathLike, busy: str | None = None,
              on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock file `path` + '.lock' while the block runs: one process at a time. When another holds
    it: raise UserError(`busy`), or with `on_wait` call it and wait for the other to finish. The lock goes
    with the process, however it ends."""
    with open(f"{path}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is None:
                raise UserError(busy or f"another process is writing {path}") from None
            on_wait()
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
