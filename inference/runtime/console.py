"""Where the command lines' output goes: answers on stdout (streamed as they are decoded), one-line notices on stderr.

Notices can come while an answer streams (a compile, the step schedule switching sizes); where both streams show on
one terminal, a notice then starts a line of its own instead of landing inside a sentence."""

import sys


class _Stdout:
    """Whether streamed text has left stdout in the middle of a line."""

    mid_line = False


_stdout = _Stdout()


def stream_text(text: str) -> None:
    """Print `text` to stdout now, with no line end of its own."""
    if text:
        print(text, end="", flush=True)
        _stdout.mid_line = not text.endswith("\n")


def end_line() -> None:
    """End the line streamed text left open (a no-op where none is)."""
    if _stdout.mid_line:
        print(flush=True)
        _stdout.mid_line = False


def to_stderr(line: str) -> None:
    """Where one-line notices go by default (progress, choices, compiling)."""
    if _stdout.mid_line:
        print(file=sys.stderr)
        _stdout.mid_line = False  # the streamed text goes on below the notice
    print(line, file=sys.stderr)
