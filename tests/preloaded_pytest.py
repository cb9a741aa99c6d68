"""pytest runs, each in a process of its own, forked from a server process that has imported torch,
hypothesis, numba and transformers once (multiprocessing's forkserver).

test_course.py grades the course 48 times, each run in a fresh process as a student's `python -m pytest
course` is. A grader run whose tests take 1 s took 8-9 s, 4-5 s of them importing these libraries
(`python -X importtime -m pytest -s course/a5_ngrams --reference`). A forked run is still its own
process: the project's modules, and a planted mistake's patches of them, are imported fresh in it.
(A forkserver needs a POSIX system: Linux, where CI runs, or macOS.)
"""

import multiprocessing
import os
import sys
from pathlib import Path

# Libraries only: none of them imports the project, so no run sees another run's code.
PRELOADED = ["torch", "numpy", "numba", "hypothesis", "pytest", "transformers"]


def _pytest_in(folder: str, args: list[str], env: dict[str, str], log: str):
    """In the forked process: `python -m pytest args` in `folder` with environment `env`, its output to `log`."""
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, folder)  # where `python -m pytest` puts it
    with open(log, "w") as output:
        os.dup2(output.fileno(), sys.stdout.fileno())
        os.dup2(output.fileno(), sys.stderr.fileno())
        import pytest

        # pytest cannot rewrite the asserts of plugins imported before it starts (hypothesis's): it warns
        # so, and their asserts are no student's concern.
        sys.exit(int(pytest.main(["-W", "ignore::pytest.PytestAssertRewriteWarning", *args])))


class PreloadedPytest:
    """Start pytest runs in processes forked from one server, which imports PRELOADED when the first starts."""

    def __init__(self):
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOADED)

    def run(self, folder: Path, args: list[str], env: dict[str, str], log: Path, timeout: float = 900) -> int:
        """Run pytest with `args` in `folder` and wait for it: its exit code. Its output goes to `log`."""
        process = self.context.Process(target=_pytest_in, args=(str(folder), list(args), dict(env), str(log)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"pytest {' '.join(args)} ran past {timeout:.0f} s (its output: {log})")
        return process.exitcode
