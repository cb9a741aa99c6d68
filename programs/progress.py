"""Progress of long work on stderr that reads well both on a terminal and in a log.

On a terminal one line is redrawn in place ("\\r"); in a log (stderr a file or a pipe) each update is
a line of its own, at most one every LOG_EVERY seconds, and the last one always:

    progress = Progress("training")
    for step in ...:
        progress.update(f"step {step}/{total}  loss {loss:.3f}")
    progress.done(f"{total} steps")
"""

import sys
import time

LOG_EVERY = 10.0  # seconds between two updates written to a log


class Progress:
    def __init__(self, what: str):
        self.what = what
        self.on_terminal = sys.stderr.isatty()
        self.last_logged = None  # when an update last went to the log

    def update(self, text: str) -> None:
        line = f"{self.what}: {text}"
        if self.on_terminal:
            print(f"\r{line}\033[K", end="", file=sys.stderr, flush=True)
            return
        now = time.monotonic()
        if self.last_logged is None or now - self.last_logged >= LOG_EVERY:
            print(line, file=sys.stderr, flush=True)
            self.last_logged = now

    def done(self, text: str) -> None:
        """The last update, always shown, and the end of the line."""
        line = f"{self.what}: {text}"
        print(f"\r{line}\033[K" if self.on_terminal else line, file=sys.stderr, flush=True)
