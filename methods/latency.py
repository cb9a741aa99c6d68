"""L(n): the seconds of one pass of the decoding loop over n inputs on this machine, the cost that
cost-aware drafting (cost_aware.py) and the hardware-aware tree size (calibrate.py) weigh guesses
against.

L(n) depends on the machine, the device, the dtype and the model, and on how busy the machine is.
So it is known three ways, each correcting the one before:

1. **Measured once** per machine, device, dtype and model, by the first run that needs it
   (calibrate.machine_latency): a pass of the loop at each of a few sizes, the sizes interleaved
   pass by pass so that a burst of load hits every size alike, in three rounds; each size's L is a
   low quantile of its passes (load only ever adds time). When other programs took a share of the
   CPUs while it measured (/proc/stat; on a GPU, or where that is not readable: when the rounds
   disagree), the machine was busy: nothing is saved, and the run relies on step 2. Concurrent first
   runs take turns (a lock): one measures, the others wait and read its table.
2. **Corrected online** by every run (`OnlineLatency`): the loop times every pass (`Pass.seconds`),
   and the estimate at a size the run has sent is the median of those passes (to within STEADY).
   Sizes not sent are the saved table scaled by the ratio measured / saved at the nearest sizes that
   were, so a table off by a constant factor is right everywhere once one size is measured, and one
   wrongly shaped is corrected size by size as the run sends them (a size is never made to look
   dearer than its neighbours say by its first passes, so that it is sent again); the curve is kept
   non-decreasing in n (`Latency`). Cost-aware drafting first sends the root alone for a couple of
   passes, so that what sending nothing costs is measured too. A wrong saved table costs the first
   few passes, not the run.
3. **Saved back** (calibrate.save_measured): every SAVE_EVERY passes, the sizes this run measured
   well (WELL_MEASURED: enough passes, a narrow spread) refresh the saved table, each entry keeping
   how many passes back it; where the run finds the saved table far off, the run's curve replaces
   it, said once on stderr. Passes timed while other processes took more than a tenth of the CPUs
   are not saved (calibrate.refresher): they timed the load, not the machine.

The saved tables live in the cache's latency.json ({machine key: {n: {"ms": L(n), "passes": k}}});
delete the file to measure again.
"""

import bisect
import statistics
from collections import deque


class Latency:
    """L(n): seconds for one forward pass over n inputs, interpolated linearly between measured sizes
    (and extended along the last segment), never decreasing in n: where a noisy measurement falls
    below a smaller size's, the two are pooled into their mean (isotonic regression). A fixed table:
    it learns nothing from the passes it is shown (OnlineLatency does)."""

    def __init__(self, seconds: dict[int, float]):
        if not seconds or min(seconds) < 1 or min(seconds.values()) <= 0:
            raise ValueError("L(n) needs positive seconds for sizes n >= 1")
        self.sizes = sorted(seconds)
        pools = []  # [mean, count] of runs of sizes, means increasing (pool adjacent violators)
        for n in self.sizes:
            pools.append([seconds[n], 1])
            while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
                (high, k), (low, j) = pools[-2], pools.pop()
                pools[-1] = [(high * k + low * j) / (k + j), k + j]
        self.seconds = [mean for mean, count in pools for _ in range(count)]

    @classmethod
    def flat(cls) -> "Latency":
        """Every pass costs the same, whatever its size (a GPU far from saturated, roughly)."""
        return cls({1: 1.0})

    def __call__(self, rows: int) -> float:
        sizes, seconds = self.sizes, self.seconds
        if len(sizes) == 1 or rows <= sizes[0]:
            return seconds[0]
        i = min(max(bisect.bisect_left(sizes, rows), 1), len(sizes) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])
        return seconds[i - 1] + slope * (rows - sizes[i - 1])

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.sizes, self.seconds))

    def observe(self, inputs: int, seconds: float) -> None:
        """A fixed table ignores the passes it is shown."""

    def measured_enough(self, inputs: int) -> bool:
        """A fixed table is trusted as it is."""
        return True


class OnlineLatency:
    """L(n) as this run measures it: a prior (the saved table) moved by every pass it is shown
    (`observe`, from the loop's own clock), robustly (medians of the last WINDOW passes per size) and
    non-decreasing in n. Called like a Latency."""

    TRUSTED = 3  # passes at a size for its median alone to stand (fewer: see fitted)
    WINDOW = 32  # the latest passes per size (the machine's load drifts)
    FIRST_PASSES = 2  # passes of a size before cost-aware drafting relies on it (measured_enough)
    SAVE_EVERY = 64  # passes between two refreshes of the saved table
    WELL_MEASURED = 8, 0.3  # passes, and the most (q3 - q1) / median, for a size to be saved
    # a pass this many times its size's estimate measured something else, a pause of the process, say
    # (a pass in which the backend compiled or recorded its program is not shown at all: `untimed`).
    # Ignored, IGNORED_AT_MOST times per size: any more such passes are a machine that did slow down,
    # and are believed.
    OUTLIER, IGNORED_AT_MOST = 20.0, 2
    # a trusted size whose median moved less than this fraction since the curve last took it leaves the
    # curve as it is: refitting on every pass cost about 40 us (this CPU), a fifth of ANPD's own time
    # per pass and more than 1% of a 2.5 ms graphed pass, to follow a median that moved less than its
    # passes' own noise
    STEADY = 0.01

    def __init__(self, prior: Latency, save=None):
        self.prior, self.save = prior, save  # save(self): refresh the saved table
        # whether the latest pass also compiled or recorded the backend's program for its size, once,
        # ten to thousands of passes' worth of time (backends/cpu_compiled.py, cuda_graphs.py): no L(n)
        self.untimed = lambda: False
        self.recent: dict[int, deque] = {}  # size -> its latest passes' seconds
        self.medians: dict[int, float] = {}  # size -> the median of its latest passes, as the curve took it
        self.seen: dict[int, int] = {}  # size -> passes of that size shown so far
        self.curve = prior
        self.saved_passes: dict[int, int] = {}  # size -> passes of it already counted in the saved table
        self.ignored: dict[int, int] = {}  # size -> its OUTLIER passes ignored so far
        self.said_far_off = False

    def __call__(self, rows: int) -> float:
        return self.curve(rows)

    def observe(self, inputs: int, seconds: float) -> None:
        """One timed pass over `inputs` inputs (a pass with no time, made by hand rather than by the
        loop, measures nothing; nor does one the backend spent preparing, `untimed`, or one of OUTLIER times
        the estimate, see there)."""
        if seconds <= 0 or self.untimed():
            return
        if seconds > self.OUTLIER * self(inputs) and self.ignored.get(inputs, 0) < self.IGNORED_AT_MOST:
            self.ignored[inputs] = self.ignored.get(inputs, 0) + 1
            return
        recent = self.recent.setdefault(inputs, deque(maxlen=self.WINDOW))
        recent.append(seconds)
        self.seen[inputs] = self.seen.get(inputs, 0) + 1
        median, taken = statistics.median(recent), self.medians.get(inputs)
        if self.seen[inputs] <= self.TRUSTED or abs(median - taken) > self.STEADY * taken:
            self.medians[inputs] = median
            self.curve = self.fitted()
        if self.save and sum(self.seen.values()) % self.SAVE_EVERY == 0:
            self.save(self)

    def measured_enough(self, inputs: int) -> bool:
        """Whether this run has timed enough passes of `inputs` inputs to trust its estimate there."""
        return self.seen.get(inputs, 0) >= self.FIRST_PASSES

    def fitted(self) -> Latency:
        """The prior at its own sizes, scaled by measured / prior, interpolated between the measured
        sizes (the nearest one's beyond them). A size measured fewer than TRUSTED times is scaled by
        the lower of its own ratio and its neighbours': one pass slowed by a burst of load must not
        make a size look so dear that it is never sent again (and so never measured again)."""
        own = {n: median / self.prior(n) for n, median in self.medians.items()}
        ratio = {n: r if self.seen[n] >= self.TRUSTED or len(own) == 1
                 else min(r, interpolate({m: o for m, o in own.items() if m != n}, n)) for n, r in own.items()}
        sizes = sorted(set(self.prior.sizes) | set(ratio))
        return Latency({n: self.prior(n) * interpolate(ratio, n) for n in sizes})

    def well_measured(self) -> dict[int, float]:
        """Seconds at each size whose recent passes are many and agree (what may be saved)."""
        passes, spread = self.WELL_MEASURED
        well = {}
        for n, recent in self.recent.items():
            if len(recent) >= passes:
                q1, median, q3 = statistics.quantiles(recent, n=4)
                if q3 - q1 <= spread * median:
                    well[n] = median
        return well


def interpolate(points: dict[int, float], n: int) -> float:
    """Linear between the points around n, the nearest point's value beyond them (1 with none)."""
    if not points:
        return 1.0
    sizes = sorted(points)
    if n <= sizes[0]:
        return points[sizes[0]]
    if n >= sizes[-1]:
        return points[sizes[-1]]
    above = bisect.bisect_left(sizes, n)
    low, high = sizes[above - 1], sizes[above]
    return points[low] + (points[high] - points[low]) * (n - low) / (high - low)
