"""Assignment a9_capstone: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a9_capstone
"""


def calibrate(model, method: str, tau_of_rows) -> tuple[int, list[dict]]:
    """Measure L(n) for every n in ROWS (and L(1)), ask tau(n), pick the best tau(n) / L(n); print
    the table as it goes."""
    raise NotImplementedError("a9_capstone: implement calibrate")
