"""Grader of a9: on a machine whose step latencies L(n) the grader decides (it replaces
calibrate.latencies), your calibration writes tau(n), L(n) and the predicted speedup tau(n) L(1) / L(n)
for every size the method can fill, and chooses the size where that is largest (PPD section 4.2)."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import adapters
import calibrate as calibrate_module
from calibrate import ROWS

calibrate = adapters.implementation("a9_capstone", "calibrate")
# a machine: L(1), then how much each size adds; a method: tau(n) rising with n, None below its smallest tree
machines = st.tuples(st.floats(1e-3, 0.1), st.lists(st.floats(0.0, 0.02), min_size=len(ROWS), max_size=len(ROWS)))
methods = st.tuples(st.integers(0, 3), st.lists(st.floats(0.0, 0.4), min_size=len(ROWS), max_size=len(ROWS)))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # it installs the machine anew each time
@given(machines, methods)
def test_the_calibration_chooses_the_largest_predicted_speedup(monkeypatch_machine, machine, method):
    one, steps = machine
    latency = {1: one} | {n: one + sum(steps[:i + 1]) for i, n in enumerate(ROWS)}
    smallest, gains = method
    tau = {n: (1 + sum(gains[:i + 1]) if i >= smallest else None) for i, n in enumerate(ROWS)}
    monkeypatch_machine(calibrate, latency)
    rows, table = calibrate(None, "a method", lambda n: tau[n])
    expected = {n: tau[n] * one / latency[n] for n in ROWS if tau[n] is not None}
    assert [entry["rows"] for entry in table] == list(expected), (
        f"the table has one entry per size the method can fill, {list(expected)}, not {[e['rows'] for e in table]}")
    for entry in table:
        n = entry["rows"]
        assert entry["latency_ms"] == pytest.approx(latency[n] * 1000, abs=0.01), (
            f"n = {n}: the table's latency_ms is L(n) in milliseconds, {latency[n] * 1000:.2f}, not {entry['latency_ms']}")
        assert entry["tau"] == pytest.approx(tau[n], abs=1e-3), (
            f"n = {n}: the table's tau is tau_of_rows(n), {tau[n]:.3f}, not {entry['tau']}")
        assert entry["predicted_speedup"] == pytest.approx(expected[n], abs=1e-3), (
            f"n = {n}: tau {tau[n]:.3f}, L(n) {latency[n] * 1000:.2f} ms, L(1) {one * 1000:.2f} ms: the predicted speedup "
            f"tau(n) L(1) / L(n) is {expected[n]:.3f}, not {entry['predicted_speedup']:.3f}")
    best = max(expected.values())
    assert expected[rows] == pytest.approx(best, abs=1e-3), (
        f"L(n) ms {({n: round(latency[n] * 1000, 2) for n in expected})}, tau(n) "
        f"{({n: round(tau[n], 3) for n in expected})}: choose the n with the largest tau(n) L(1) / L(n), "
        f"{max(expected, key=expected.get)} ({best:.3f}), not {rows} ({expected[rows]:.3f})")


@pytest.fixture
def monkeypatch_machine(monkeypatch):
    """Replace the L(n) measurement (calibrate.latencies, however `function` reaches it) by a known machine."""
    def install(function, latency):
        def measured(model, sizes, rounds=3):
            return {n: latency[n] for n in sizes}
        for namespace in [vars(calibrate_module), function.__globals__]:
            if "latencies" in namespace:
                monkeypatch.setitem(namespace, "latencies", measured)
            if "machine_key" in namespace:
                monkeypatch.setitem(namespace, "machine_key", lambda model: "the grader's machine")
    return install
