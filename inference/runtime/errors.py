"""How command-line entry points report bad input: one clear line on stderr, never a traceback.

The library raises plain `ValueError`s (MedusaLoadError, TreeError and UserError are ValueErrors) with
messages that say what is wrong; the entry points turn any of them into an `error:` line.
"""

import sys
from collections.abc import Callable


class UserError(ValueError):
    """Bad input or environment the user can fix; the message says how."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message, for a one-line report: some run to many lines (torch.save's
    full-disk error), some are empty."""
    return (str(error).splitlines() or [""])[0]


def to_stderr(line: str) -> None:
    """Where one-line notices go by default (progress, choices, compiling)."""
    print(line, file=sys.stderr)


def run_command(body: Callable[[], None], interrupted: str = "interrupted") -> int:
    """Exit status of a command-line entry point: bad input is one `error:` line and status 2, Ctrl-C a
    short note and 130."""
    try:
        body()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr)
        return 130
    return 0
