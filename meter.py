"""Keeping score of a generation: seconds per phase, and what its forward passes did.

The decoding loops (decode.py, apar.py) say what happens; the meter keeps the clocks, so they do not
clutter them, and `Counts` is the record of passes and guesses both loops fill in, one visible line
per pass:

    meter = Meter(device)
    with meter.time("forward"):      # adds the block's wall-clock seconds to seconds["forward"]
        ...                          # (and keeps them in last["forward"])
    meter.elapsed()                  # seconds since the meter was made
    counts.add_pass(proposed=7, accepted=3, rejected=True)

On a GPU the clock first waits for the queued work, so the seconds are the work's, not its launch's.
"""

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class Meter:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seconds: Counter[str] = Counter()  # phase -> seconds spent in it
        self.last: dict[str, float] = {}  # phase -> seconds of its latest timed block
        self.started = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def time(self, phase: str):
        started = self.now()
        try:
            yield
        finally:
            self.last[phase] = self.now() - started
            self.seconds[phase] += self.last[phase]

    def elapsed(self) -> float:
        return self.now() - self.started


@dataclass
class Counts:
    """What a generation's forward passes did."""
    forward_passes: int = 0  # the prefill's included
    guesses_proposed: int = 0  # guessed tokens sent through the model
    guesses_accepted: int = 0  # of those, tokens that became output
    rejections: int = 0  # passes that ended at a rejected guess (the others ran out of guesses)

    def add_pass(self, proposed: int = 0, accepted: int = 0, rejected: bool = False) -> None:
        self.forward_passes += 1
        self.guesses_proposed += proposed
        self.guesses_accepted += accepted
        self.rejections += int(rejected)
