"""`UserError`, the exception for mistakes in the user's input, and how the programs report problems
and refuse bad options.

The programs (decode.py, train_prompt.py, bench.py) run their `main` through `run_program`, so that a
mistake of the user's or a problem of the machine is one `error:` line on stderr and a non-zero exit,
never a traceback: a `UserError`, Ctrl-C, a file or folder that cannot be read or written (a full
disk, a read-only cache), a standard stream that is closed. Anything else is a bug and keeps its
traceback.

Importing this module also makes an uncaught Ctrl-C one line: the programs import it before torch, so
that this holds while the slow imports run too.
"""

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

INTERRUPTED = 130  # the exit status of a program stopped by Ctrl-C (128 + SIGINT), as shells report it


class UserError(Exception):
    """A problem with what the user asked for (a path, a checkpoint, an option), not a bug."""


class TooFewRows(UserError):
    """A size (inputs per forward pass) too small for the smallest tree a method can build."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (the usage block is in --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help with each option's default said once: appended where there is a value to show and the
    help text does not already say what happens by default."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and "default" not in text
        return text + " (default: %(default)s)" if shown and action.option_strings else text


def report(message: str) -> None:
    """One line on stderr, if there is a stderr to write to."""
    if sys.stderr is not None:
        print(f"error: {message}", file=sys.stderr, flush=True)


def unwritable(path: Path, err: OSError) -> str:
    """Why `path` cannot be written, in words: a folder above it that is a file, else the system's reason."""
    files = [folder for folder in path.parents if folder.exists() and not folder.is_dir()]
    return f"{files[0]} is a file, not a folder" if files else err.strerror or str(err)


def writable(path: Path, option: str) -> Path:
    """`path`, checked to be writable now rather than after the long work that produces it: its folder
    exists or can be made, a file can be written there, and it is not itself a folder. `option` names
    it in the error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise UserError(f"cannot write {option} {path} ({unwritable(path, err)}); choose a path in a writable "
                        "folder") from None
    if path.is_dir():
        raise UserError(f"cannot write {option} {path}: it is a folder; name a file")
    return path


def run_program(main: Callable[[], int | None], interrupted: str = "") -> int:
    """Run a program's `main`, turning every problem that is not a bug into one `error:` line and an
    exit status. `interrupted` says what Ctrl-C leaves behind, if anything."""
    try:
        if sys.stdout is None:  # started with stdout closed (`>&-`): the answer would vanish
            raise UserError("standard output is closed; redirect it to a file or /dev/null instead")
        return main() or 0
    except UserError as err:
        report(str(err))
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop writing, quietly for it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail
        report("standard output was closed before the answer was complete (piped into head?)")
    except MemoryError:
        report("out of memory; try a shorter --max-new-tokens, fewer inputs per pass, or --dtype bfloat16")
    except NotImplementedError as err:  # a function still to write (a course starter's), or an op torch lacks here
        report(f"not implemented: {str(err).strip().splitlines()[0] if str(err).strip() else 'NotImplementedError'}")
    except BaseException as err:  # Ctrl-C (or an error it caused), a file problem, else a bug or an exit
        if caused_by_ctrl_c(err):
            report("interrupted (Ctrl-C)" + (f"; {interrupted}" if interrupted else ""))
            return INTERRUPTED
        if not isinstance(err, OSError):
            raise  # argparse's exit, or a bug: its traceback is the report
        where = f" ({err.filename})" if err.filename else ""  # a file or folder we may not read or write
        report(f"{err.strerror or err}{where}; check that the path exists, is writable and has free space")
    return 1


def caused_by_ctrl_c(error: BaseException | None) -> bool:
    """Whether Ctrl-C is behind `error`: a KeyboardInterrupt raised inside a library, say while a
    C extension initialises, can reach us as an ImportError or SystemError that it caused."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt):
            return True
        error = error.__cause__ or error.__context__
    return False


def print_interrupt_as_one_line(hook: Callable) -> Callable:
    """A sys.excepthook that prints Ctrl-C outside run_program (while torch is imported, say) as one
    line, and hands every other exception to `hook`."""
    def excepthook(kind, value, traceback):
        if caused_by_ctrl_c(value):
            report("interrupted (Ctrl-C)")
        else:
            hook(kind, value, traceback)
    return excepthook


sys.excepthook = print_interrupt_as_one_line(sys.excepthook)


# ---- argparse types: a number out of range is a usage error that names its option -------------------

def integer(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in low..high (a huge one is refused here, not deep in the code)."""
    return in_range(int, "a whole number", low, high, f"{low}..{high}")


def number(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite float in [low, high] (inf and nan are refused: nan fails every
    comparison)."""
    return in_range(float, "a number", low, high, f"[{low:g}, {high:g}]")


def in_range(convert: Callable, kind: str, low, high, shown: str) -> Callable[[str], int | float]:
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {shown}, got {text}")
        return value
    return parse
