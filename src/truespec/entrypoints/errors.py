"""User errors on the command line: one line on stderr and exit code 2. Any other exception is a bug and keeps
its traceback."""

import sys
from collections.abc import Callable

USER_ERRORS = (ValueError, FileNotFoundError)  # what the engine raises for bad input, naming it


def run_command(run: Callable[[], int]) -> int:
    """``run()``'s exit code, or 2 after printing a user error."""
    try:
        return run()
    except USER_ERRORS as e:
        print(f"error: {e}".encode("utf-8", "backslashreplace").decode(), file=sys.stderr)  # a lone surrogate
        return 2
