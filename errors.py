"""The one exception type for mistakes in the user's input.

The CLI prints a `UserError` as a single line on stderr and exits non-zero; anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem with what the user asked for (a path, a checkpoint, an option), not a bug."""
