"""How command-line entry points report bad input: one clear line on stderr, never a traceback.

The library raises plain `ValueError`s (MedusaLoadError, TreeError and UserError are ValueErrors) with
messages that say what is wrong; the entry points turn any of them into an `error:` line.
"""

import os
import sys
from collections.abc import Callable


class UserError(ValueError):
    """Bad input or environment the user can fix; the message says how."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message, for a one-line report: some run to many lines (torch.save's
    full-disk error), some are empty."""
    return (str(error).splitlines() or [""])[0]


def run_command(body: Callable[[], None], interrupted: str = "interrupted") -> int:
    """Exit status of a command-line entry point: bad input is one `error:` line and status 2, Ctrl-C a
    short note and 130, a reader of stdout that went away (`| head`) a quiet stop with 141, as a shell's SIGPIPE."""
    try:
        body()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return 141
    return 0


def _discard_stdout() -> None:
    """Point stdout at the null device, so that flushing it at exit does not fail on the closed pipe again."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing is flushed to a pipe
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, descriptor)
    os.close(null)
