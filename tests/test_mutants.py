"""The tests can fail: each mistake below (one a student or a tired engineer would make) is planted in
a copy of the code, and the test file that guards that code must go red under the default (CI)
hypothesis profile. A mutant that survives means a property test draws too few examples, or checks
too little.

    python -m pytest tests/test_mutants.py -v        # about a minute
"""

import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

MUTANTS = {  # name -> (file, the correct code, the mistake, the test file that must catch it)
    "n-gram: the shortest context wins": (
        "drafters.py", "for length in range(min(self.n - 1, len(tokens)), 0, -1):",
        "for length in range(1, min(self.n - 1, len(tokens)) + 1):", "test_drafters.py"),
    "tree: position = cache length + node index, not + depth": (
        "tree.py", "return torch.tensor(self.depths + slots, device=device) + cache_length",
        "return torch.arange(len(self.depths) + len(slots), device=device) + cache_length", "test_tree.py"),
    "tree: a causal mask instead of the ancestor mask": (
        "tree.py", "mask[node] |= mask[self.parents[node]]", "mask[node] |= mask[node - 1]", "test_tree.py"),
    "verify: accept with p(x), not p(x) / q(x)": (
        "verify.py", "if chance.accept(residual[token] / q[token]):", "if chance.accept(residual[token]):",
        "test_verify.py"),
    "verify: after a rejection draw from p, not norm(max(0, p - q))": (
        "verify.py", "residual = residual_after_rejection(residual, q)", "pass", "test_verify.py"),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_a_planted_mistake_is_caught(name, tmp_path):
    file, correct, mistake, guard = MUTANTS[name]
    source = (ROOT / file).read_text()
    assert source.count(correct) == 1, f"{file} changed: update this mutant"
    shutil.copytree(ROOT, tmp_path / "copy", ignore=shutil.ignore_patterns(".git", "__pycache__", ".*", "trained"))
    (tmp_path / "copy" / file).write_text(source.replace(correct, mistake))
    env = os.environ | {"HYPOTHESIS_PROFILE": "ci"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"tests/{guard}"],
                         cwd=tmp_path / "copy", env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, f"the mistake survived tests/{guard}:\n{run.stdout[-2000:]}"
