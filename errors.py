"""`UserError`, the exception for mistakes in the user's input, and the parser that reports them.

The command lines print a `UserError` as a single line on stderr and exit non-zero; anything else is
a bug and keeps its traceback.
"""

import argparse


class UserError(Exception):
    """A problem with what the user asked for (a path, a checkpoint, an option), not a bug."""


class TooFewRows(UserError):
    """A size (inputs per forward pass) too small for the smallest tree a method can build."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (the usage block is in --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
