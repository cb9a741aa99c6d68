"""Progress in a log (progress.py): when stderr is not a terminal, each update is a line of its own
(never a "\\r"-glued line), at most one per LOG_EVERY seconds, and the last one always."""

from programs import progress


def test_in_a_log_each_update_is_its_own_line(capsys, monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 11.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    shown = progress.Progress("measuring L(n)")
    for round_number in range(1, 5):
        shown.update(f"round {round_number}/4")
    shown.done("4 rounds")
    assert capsys.readouterr().err == ("measuring L(n): round 1/4\n"  # at 0 s
                                       "measuring L(n): round 4/4\n"  # at 11 s (2 and 3, at 1 and 2 s: too soon)
                                       "measuring L(n): 4 rounds\n")


def test_on_a_terminal_one_line_is_redrawn(capsys, monkeypatch):
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True)
    shown = progress.Progress("training")
    shown.update("step 1/2")
    shown.update("step 2/2")
    shown.done("2 steps")
    assert capsys.readouterr().err == ("\rtraining: step 1/2\033[K\rtraining: step 2/2\033[K"
                                       "\rtraining: 2 steps\033[K\n")
