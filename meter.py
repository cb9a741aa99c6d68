"""Keeping score of a generation: seconds per phase and counts of events.

The decoding loops (decode.py, apar.py) say what happens; the meter keeps the score, so clocks and
counters do not clutter them:

    meter = Meter(device)
    with meter.time("forward"):      # adds the block's wall-clock seconds to seconds["forward"]
        ...
    meter.count(forward_passes=1)    # adds to counts["forward_passes"]
    meter.elapsed()                  # seconds since the meter was made

On a GPU the clock first waits for the queued work, so the seconds are the work's, not its launch's.
"""

import time
from collections import Counter
from contextlib import contextmanager

import torch


class Meter:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seconds: Counter[str] = Counter()  # phase -> seconds spent in it
        self.counts: Counter[str] = Counter()  # event -> how many
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
            self.seconds[phase] += self.now() - started

    def count(self, **events: int) -> None:
        self.counts.update(events)

    def elapsed(self) -> float:
        return self.now() - self.started
