"""The one exception type that command-line entry points turn into a single clear line on stderr."""


class UserError(Exception):
    """Bad input or environment the user can fix; the message says how."""
