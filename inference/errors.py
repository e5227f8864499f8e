"""The one exception type that command-line entry points turn into a single clear line on stderr."""


class UserError(Exception):
    """Bad input or environment the user can fix; the message says how."""


def run_command(body, interrupted: str = "interrupted") -> int:
    """Exit status of a command-line entry point: bad input is one `error:` line and status 2, Ctrl-C a
    short note and 130, never a traceback."""
    import sys

    try:
        body()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr)
        return 130
    return 0
