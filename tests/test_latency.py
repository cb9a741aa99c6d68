"""This machine's L(n) (latency.py, calibrate.py's measurement and saved table): a wrong saved table
(flat, 10x, 0.1x, or the shapes that a busy first run measured) costs cost-aware drafting a few
passes, not the run; the online estimate is robust to outliers and never decreases in n; the loop
shows it every pass's time; a busy first measurement is not saved, concurrent first runs measure
once, and what a run measured well is saved back, a far-off table replaced, said once."""

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

import calibrate
from methods.cost_aware import CostAware, Costs, reach
from decode import generate
from drafters import NGramDrafter, Pass
from helpers import tiny_model
from methods.latency import Latency, OnlineLatency
from tree import Tree, Verdict

MS = 1e-3
# this CPU's L(n) measured quietly (a whole pass of the loop, 256 cached tokens): a step from 1 input
# to 2 (matrix-vector to matrix-matrix kernels), then slowly rising
TRUE = Latency({1: 22.2 * MS, 2: 35.9 * MS, 6: 35.9 * MS, 8: 41.3 * MS, 12: 47.4 * MS, 16: 53.8 * MS,
                24: 73.1 * MS, 32: 88.4 * MS})
PLANTED = {
    "flat": Latency({1: 30 * MS}),
    "10x": Latency({n: 10 * s for n, s in TRUE.as_dict().items()}),
    "0.1x": Latency({n: 0.1 * s for n, s in TRUE.as_dict().items()}),
    # measured right after the model's conversion: L(1) 1.3x too high, L(2..6) / L(1) 1.27 instead of 1.62
    "first run, just converted": Latency({1: 28.8 * MS, 2: 36.6 * MS, 6: 36.6 * MS, 8: 42 * MS, 16: 54 * MS,
                                          32: 89 * MS}),
    # measured by three first runs started together: 287 ms, flat up to 24 inputs
    "three first runs at once": Latency({1: 287 * MS, 2: 385 * MS, 24: 385 * MS, 32: 420 * MS}),
}
DRAFTER_MS = 3  # the drafter's own time per pass (Medusa's heads cost about this): it makes L's level matter
RECOVERY_PASSES = 8  # passes after which a planted table's choices are about as good as the true table's:
NEAR_BEST = 0.005  # within this fraction of the best expected tokens per second, on average


def chain_proposal(rng: random.Random) -> Tree:
    """Candidates as a guesser offers them: a chain of 1-12 guesses, each filed by its depth, with a
    prior that varies pass to pass (so that different sizes are the best at different passes)."""
    depth = rng.randint(1, 12)
    confidence = rng.uniform(0.3, 0.95)
    return Tree.chain(0, list(range(1, depth + 1)),
                      evidence=[((("depth", d), confidence ** d),) for d in range(1, depth + 1)])


def simulated_pass(tree: Tree, rng: random.Random, rate: float, latency: Latency) -> Pass:
    """The pass over `tree`: each guess accepted with probability `rate` while its parent was, and the
    pass's seconds what `latency` (the machine's true L(n)) says."""
    path = [0]
    while path[-1] + 1 < len(tree) and rng.random() < rate:
        path.append(path[-1] + 1)
    return Pass(tree, 0, path, [0] * len(path), None, None, Verdict.of(tree, path, 0),
                seconds=latency(tree.input_count))


def regrets(costs: Costs, passes: int = 200, seed: int = 0) -> list[float]:
    """Per pass, how much lower the expected tokens per second of what `costs` sent are than the best
    choice's, both judged with the true L(n) and the same acceptance estimates and drafter time, as a
    fraction (0: as good as knowing the true L(n)). The pass times shown to `costs` are the true ones."""
    rng = random.Random(seed)
    knowing = Costs(TRUE)
    lost = []
    for _ in range(passes):
        candidates = chain_proposal(rng)
        costs.drafter_seconds += DRAFTER_MS * MS
        knowing.estimates, knowing.drafter_seconds, knowing.passes = costs.estimates, costs.drafter_seconds, costs.passes + 1
        best = knowing.best_part(candidates)
        tree = costs.cut(candidates)

        def rate(sent):
            return sum(reach(sent, knowing.estimates_of(sent))) / knowing.pass_cost(sent.input_count)
        lost.append(1 - rate(tree) / rate(best))
        costs.learn(simulated_pass(tree, rng, 0.7, TRUE))
    return lost


def late_loss(costs: Costs, seed: int) -> float:
    """The mean of `regrets` from pass RECOVERY_PASSES on."""
    lost = regrets(costs, seed=seed)[RECOVERY_PASSES:]
    return sum(lost) / len(lost)


@pytest.mark.parametrize("planted", PLANTED)
def test_a_planted_table_costs_only_the_first_passes(planted):
    """From pass RECOVERY_PASSES on, the passes' choices lose on average under NEAR_BEST of the best
    expected tokens per second (the true L(n) known), whatever table was planted."""
    assert max(late_loss(Costs(OnlineLatency(PLANTED[planted])), seed) for seed in range(10)) < NEAR_BEST


def test_with_the_true_table_as_prior_only_measuring_what_sending_nothing_costs_loses():
    for seed in range(10):
        lost = regrets(Costs(OnlineLatency(TRUE)), seed=seed)
        assert max(lost[OnlineLatency.FIRST_PASSES:]) <= 1e-12


@pytest.mark.parametrize("planted", ["flat", "three first runs at once"])
def test_a_planted_table_kept_fixed_would_lose_all_along(planted):
    """What cost-aware drafting did before it learned from its passes: a wrongly shaped table kept
    fixed loses ten times NEAR_BEST all along (so the test above can fail). (A table off by a constant
    factor misjudges only the drafter's own time next to L.)"""
    assert min(late_loss(Costs(PLANTED[planted]), seed) for seed in range(10)) > 10 * NEAR_BEST


def test_outliers_do_not_move_the_estimate():
    online = OnlineLatency(TRUE)
    for i in range(40):
        online.observe(4, 10 * TRUE(4) if i % 5 == 0 else TRUE(4))  # one pass in five hit by a burst of load
    assert online(4) == pytest.approx(TRUE(4))


def test_a_pass_far_slower_than_its_estimate_measures_nothing():
    """A pass far slower than L(n) (the process paused) measures nothing: two sizes slowed one after
    the other must not each vouch for the other's time, and a machine that did slow down is believed
    after a few."""
    online = OnlineLatency(TRUE)
    for inputs in [2, 4]:
        online.observe(inputs, 30.0)
    online.observe(2, TRUE(2))
    assert [online(n) for n in [1, 2, 4]] == pytest.approx([TRUE(n) for n in [1, 2, 4]])
    for _ in range(OnlineLatency.IGNORED_AT_MOST + OnlineLatency.TRUSTED):
        online.observe(8, 30 * TRUE(8))
    assert online(8) > 10 * TRUE(8)


def test_the_estimate_follows_a_drifting_machine_to_within_steady(monkeypatch):
    """Refitting only when a size's median moves by more than STEADY leaves the estimate within STEADY
    of the median all along a slow drift and a jump; a machine that runs steadily refits rarely."""
    online, rng = OnlineLatency(TRUE), random.Random(0)
    fits = []
    fitted = online.fitted
    monkeypatch.setattr(online, "fitted", lambda: fits.append(1) or fitted())
    steady = [TRUE(4) * rng.uniform(0.99, 1.01) for _ in range(200)]
    drift = [TRUE(4) * (1 + 0.003 * i) * rng.uniform(0.95, 1.05) for i in range(200)]
    jump = [3 * TRUE(4) * rng.uniform(0.95, 1.05) for _ in range(40)]
    for phase in (steady, drift, jump):
        fits.clear()
        for seconds in phase:
            online.observe(4, seconds)
            assert online(4) == pytest.approx(statistics.median(online.recent[4]), rel=OnlineLatency.STEADY)
        if phase is steady:
            assert len(fits) <= OnlineLatency.TRUSTED + 5


@given(st.lists(st.tuples(st.integers(1, 40), st.floats(1e-4, 1.0)), max_size=60),
       st.dictionaries(st.integers(1, 40), st.floats(1e-3, 1.0), min_size=1, max_size=6))
def test_the_online_estimate_never_decreases_in_n(passes, prior):
    online = OnlineLatency(Latency(prior))
    for inputs, seconds in passes:
        online.observe(inputs, seconds)
    values = [online(n) for n in range(1, 50)]
    assert all(a <= b * (1 + 1e-12) for a, b in zip(values, values[1:]))


def test_a_table_off_by_a_factor_is_right_everywhere_after_one_size_is_measured():
    online = OnlineLatency(PLANTED["10x"])
    for _ in range(3):
        online.observe(8, TRUE(8))
    assert [online(n) for n in [1, 2, 5, 8, 20, 32]] == pytest.approx([TRUE(n) for n in [1, 2, 5, 8, 20, 32]])


def test_the_loop_shows_every_decoding_pass_its_time():
    model = tiny_model(0)
    online = OnlineLatency(Latency({1: 1.0}))
    costs = Costs(online)
    gen = generate(model, [1, 2, 3, 1, 2, 3], max_new_tokens=30, eos_ids=set(),
                   drafter=CostAware(NGramDrafter(n=3, k=4), costs))
    assert sum(online.seen.values()) == gen.counts.forward_passes - 1  # not the prefill
    assert all(0 < s < 1 for recent in online.recent.values() for s in recent)


def test_a_pass_in_which_the_backend_prepared_its_program_is_no_measurement(monkeypatch):
    """A backend that compiled or recorded the pass's program (prepared_last_pass) spent ten to thousands
    of passes' time on it once: that pass does not move L(n); the next one, plain, does."""
    monkeypatch.setattr(calibrate, "THIS_RUN", {})
    monkeypatch.setattr(calibrate, "machine_key", lambda model: "a machine")
    monkeypatch.setattr(calibrate, "saved_or_measured", lambda model, key: TRUE)
    model = SimpleNamespace(prepared_last_pass=True)
    online = calibrate.machine_latency(model)
    online.observe(1, 15 * TRUE(1))
    assert online.seen == {}
    model.prepared_last_pass = False
    online.observe(1, TRUE(1))
    assert online.seen == {1: 1}


def test_cost_aware_drafting_first_measures_what_sending_nothing_costs():
    costs = Costs(OnlineLatency(Latency.flat()))
    assert not costs.latency.measured_enough(1) and costs.draft_length(0.1, 4, prior=0.5) == 0
    assert costs.cut(Tree.chain(0, [1, 2], evidence=[((("a",), 0.9),)] * 2)).draft_size == 0


# ---- the saved table -----------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    return tmp_path


ON_THE_CPU = SimpleNamespace(device=torch.device("cpu"))  # the model, as calibrate's measurement sees it


def fake_machine(monkeypatch, seconds_of, others: float | None = 0.0):
    """calibrate's timed passes replaced by `seconds_of(rows, call)` (no model runs), while other
    programs take `others` of the CPUs (None: not readable, as where there is no /proc/stat)."""
    calls = []
    monkeypatch.setattr(calibrate, "share_of_others", lambda before, after: others)

    def timed_pass(model, cache, rows, whole_step=False):
        calls.append(rows)
        return seconds_of(rows, len(calls))
    monkeypatch.setattr(calibrate, "timed_pass", timed_pass)
    monkeypatch.setattr(calibrate, "prefilled_cache", lambda model, cached, room: None)
    return calls


def test_a_first_measurement_is_saved_when_its_rounds_agree(cache, monkeypatch):
    fake_machine(monkeypatch, lambda rows, call: TRUE(rows))
    measured = calibrate.saved_or_measured(ON_THE_CPU, "this machine")
    assert measured.as_dict() == pytest.approx({n: TRUE(n) for n in calibrate.LATENCY_SIZES})
    saved = json.loads((cache / "latency.json").read_text())["this machine"]
    assert saved["1"] == {"ms": pytest.approx(22.2), "passes": calibrate.ROUNDS * calibrate.PASSES_PER_ROUND}


def bursty(rows, call):
    """The machine's passes, 3x slower in the last of the rounds (a burst)."""
    per_round = len(calibrate.LATENCY_SIZES) * calibrate.PASSES_PER_ROUND
    return TRUE(rows) * (3 if call > len(calibrate.LATENCY_SIZES) + 2 * per_round else 1)


def test_a_first_measurement_while_other_programs_run_is_used_but_not_saved(cache, monkeypatch, capsys):
    fake_machine(monkeypatch, lambda rows, call: TRUE(rows), others=0.37)  # rounds agree: slow alike
    measured = calibrate.saved_or_measured(ON_THE_CPU, "this machine")
    assert measured(1) == pytest.approx(TRUE(1))
    assert not (cache / "latency.json").exists()
    assert "other programs took 37% of the CPUs" in capsys.readouterr().err


def test_a_burst_on_an_otherwise_idle_machine_is_saved_at_its_low_quantile(cache, monkeypatch):
    """Rounds that disagree while nothing else runs: bursts of the VM, which the low quantile already
    leaves out (on this project's 2-core VM, idle rounds differ 1.1-1.7x)."""
    fake_machine(monkeypatch, bursty, others=0.01)
    assert calibrate.saved_or_measured(ON_THE_CPU, "this machine")(1) == pytest.approx(TRUE(1))
    assert json.loads((cache / "latency.json").read_text())["this machine"]["1"]["ms"] == pytest.approx(22.2)


@pytest.mark.parametrize("others, device", [(None, "cpu"), (0.0, "cuda")])
def test_where_others_cannot_be_told_rounds_that_disagree_mean_busy(cache, monkeypatch, capsys, others, device):
    """No /proc/stat, or passes on a GPU (whose other users the CPUs do not show): the rounds decide."""
    fake_machine(monkeypatch, bursty, others=others)
    measured = calibrate.saved_or_measured(SimpleNamespace(device=torch.device(device)), "this machine")
    assert measured(1) == pytest.approx(TRUE(1))  # a low quantile: the load's passes are not the machine's
    assert not (cache / "latency.json").exists()
    assert "rounds differ by up to 3.00x" in capsys.readouterr().err


def test_others_share_of_the_cpus_leaves_out_this_process_own_time():
    before, after = (1000, 100, 50), (1400, 500, 440)  # (all ticks, not idle, this process's)
    assert calibrate.share_of_others(before, after) == pytest.approx(10 / 400)
    assert calibrate.share_of_others(None, after) is None
    now = calibrate.cpu_ticks()  # this machine's, where readable
    assert now is None or (now[0] >= now[1] >= 0 and now[2] >= 0)


def test_a_program_run_and_waited_for_counts_as_this_process_own_time():
    """bench.py runs llama.cpp between its own passes: its CPU time is not another program's load."""
    before = calibrate.cpu_ticks()
    if before is None:
        pytest.skip("no /proc/stat here")
    subprocess.run([sys.executable, "-c", "import time\nstart = time.process_time()\n"
                    "while time.process_time() - start < 0.5: pass"], check=True)
    after = calibrate.cpu_ticks()
    assert after[2] - before[2] >= 0.4 * os.sysconf("SC_CLK_TCK")


def test_concurrent_first_runs_measure_once(cache, monkeypatch):
    calls = fake_machine(monkeypatch, lambda rows, call: time.sleep(0.001) or TRUE(rows))
    found = []
    runs = [threading.Thread(target=lambda: found.append(calibrate.saved_or_measured(ON_THE_CPU, "this machine")(1)))
            for _ in range(3)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert found == pytest.approx([TRUE(1)] * 3)
    warm_up = len(calibrate.LATENCY_SIZES)
    assert len(calls) == warm_up + calibrate.ROUNDS * calibrate.PASSES_PER_ROUND * len(calibrate.LATENCY_SIZES)


def measured_by_a_run(prior: Latency, truth: Latency, sizes=(1, 4), passes=40) -> OnlineLatency:
    online = OnlineLatency(prior)
    for i in range(passes):
        online.observe(sizes[i % len(sizes)], truth(sizes[i % len(sizes)]))
    return online


def test_what_a_run_measured_well_refreshes_the_saved_table(cache):
    saved = {n: {"ms": round(TRUE(n) / MS * 1.1, 3), "passes": 15} for n in [1, 4, 8]}  # 10% off: blended
    (cache / "latency.json").write_text(json.dumps({"this machine": saved}))
    online = measured_by_a_run(TRUE, TRUE)
    calibrate.save_measured("this machine", online)
    calibrate.save_measured("this machine", online)  # passes already saved are not counted twice
    table = json.loads((cache / "latency.json").read_text())["this machine"]
    assert table["1"] == {"ms": pytest.approx((22.2 * 1.1 * 15 + 22.2 * 20) / 35, abs=1e-3), "passes": 35}
    assert table["8"] == saved[8]


def test_a_far_off_saved_table_is_replaced_and_said_once(cache, capsys):
    (cache / "latency.json").write_text(json.dumps({"this machine": {"1": 287.0, "2": 385.0, "24": 385.0},
                                                    "another machine": {"1": 1.0}}))
    online = measured_by_a_run(PLANTED["three first runs at once"], TRUE)
    calibrate.save_measured("this machine", online)
    calibrate.save_measured("this machine", measured_by_a_run(TRUE, TRUE))
    saved = json.loads((cache / "latency.json").read_text())
    assert saved["this machine"]["1"]["ms"] == pytest.approx(22.2, rel=0.01)
    assert saved["this machine"]["4"]["ms"] == pytest.approx(TRUE(4) / MS, rel=0.01)
    assert saved["another machine"] == {"1": 1.0}
    assert capsys.readouterr().err.count("far off") == 1


def test_a_run_saves_every_so_many_passes():
    saves = []
    online = OnlineLatency(TRUE, save=saves.append)
    for _ in range(2 * OnlineLatency.SAVE_EVERY):
        online.observe(1, TRUE(1))
    assert saves == [online, online]


def test_a_cache_this_run_cannot_write_leaves_l_its_own(cache, monkeypatch, capsys):
    def refused(path):
        raise PermissionError(13, "Permission denied")
    fake_machine(monkeypatch, lambda rows, call: TRUE(rows))
    monkeypatch.setattr(calibrate, "locked", refused)
    assert calibrate.saved_or_measured(ON_THE_CPU, "this machine")(1) == pytest.approx(TRUE(1))
    assert "cannot write" in capsys.readouterr().err and not (cache / "latency.json").exists()
    online = OnlineLatency(TRUE, save=lambda online: calibrate.save_or_say("this machine", online))
    for _ in range(2 * OnlineLatency.SAVE_EVERY):  # a failed save mid-generation is said once; decoding goes on
        online.observe(1, TRUE(1))
    assert capsys.readouterr().err.count("cannot save L(n)") == 1 and online.save is None


def test_passes_a_replaced_table_counted_are_not_counted_again(cache):
    (cache / "latency.json").write_text(json.dumps({"this machine": {"1": 287.0, "2": 385.0, "24": 385.0}}))
    online = measured_by_a_run(PLANTED["three first runs at once"], TRUE, sizes=(1, 1, 1, 4, 6), passes=20)
    calibrate.save_measured("this machine", online)  # replaced: every size seen counted, 6's 4 passes too
    for _ in range(10):
        online.observe(6, TRUE(6))
    calibrate.save_measured("this machine", online)  # blended: only the 10 new passes of 6 are added
    table = json.loads((cache / "latency.json").read_text())["this machine"]
    assert table["6"]["passes"] == online.seen[6] == 14


def test_passes_timed_on_a_busy_machine_are_not_saved(cache, monkeypatch, capsys):
    """A run's refresh of the saved table skips the passes during which other programs took more than
    OTHERS_BUSY of the CPUs (said once), and saves again once the machine is quiet."""
    ticks = iter([(0, 0, 0), (1000, 900, 400), (2000, 1800, 800), (3000, 2300, 1300)])  # (all, busy, own)
    monkeypatch.setattr(calibrate, "cpu_ticks", lambda: next(ticks))
    online = OnlineLatency(TRUE, save=calibrate.refresher("this machine"))  # reads (0, 0, 0)
    for _ in range(OnlineLatency.SAVE_EVERY):  # others took 50% of the CPUs
        online.observe(1, 3 * TRUE(1))
    for _ in range(OnlineLatency.SAVE_EVERY):  # 50% again
        online.observe(1, 3 * TRUE(1))
    assert not (cache / "latency.json").exists()
    assert capsys.readouterr().err.count("not saved") == 1
    for _ in range(OnlineLatency.SAVE_EVERY):  # quiet: its own passes only
        online.observe(1, TRUE(1))
    assert json.loads((cache / "latency.json").read_text())["this machine"]["1"]["ms"] == pytest.approx(22.2, rel=0.01)
