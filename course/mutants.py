"""Mutation testing of the graders: mistakes written by a machine, not by the graders' author.

    python course/mutants.py [ASSIGNMENT ...]     # default: every assignment

Each mutant is the reference with one small change in one function of an assignment, the kind a
tired student makes: a comparison off by one (< for <=), an operator swapped (+ for -), a constant
off by one, `and` for `or`, max for min, a `not` dropped, or one statement left out. Each is graded
with its assignment's grader (`--reference`, in a scratch copy of the project, two at a time) and
counts as caught when a grader test fails. The survivors are printed: each is either equivalent to
the reference (no output can differ, as a bounds check that the caller never trips) or a gap in the
grader. course/mistakes.py holds the hand-written mistakes, each with the message it must get.
"""

import ast
import copy
import queue
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

COURSE = Path(__file__).resolve().parent
ROOT = COURSE.parent
sys.path[:0] = [str(ROOT), str(COURSE)]

from assignments import ASSIGNMENTS, assignments_asked, module_file, split_entry  # noqa: E402
from strip import NOT_COPIED, definitions, first_line  # noqa: E402

SWAPPED = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
           ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
           ast.And: ast.Or, ast.Or: ast.And}


def changes(node: ast.AST) -> Iterator[tuple[str, callable]]:
    """(what, apply) for each one-step change of this node; apply(node) mutates a copy of it in place.
    `what` starts with the line changed when that is not the node's own (a statement left out)."""
    def swap(attribute, index=None):
        def apply(target):
            if index is None:
                setattr(target, attribute, SWAPPED[type(getattr(target, attribute))]())
            else:
                getattr(target, attribute)[index] = SWAPPED[type(getattr(target, attribute)[index])]()
        return apply

    if isinstance(node, ast.Compare):
        for index, op in enumerate(node.ops):
            if type(op) in SWAPPED:
                yield f"{type(op).__name__} -> {SWAPPED[type(op)].__name__}", swap("ops", index)
    elif isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)) and type(node.op) in SWAPPED:
        yield f"{type(node.op).__name__} -> {SWAPPED[type(node.op)].__name__}", swap("op")
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield f"{node.value} -> {not node.value}", lambda target: setattr(target, "value", not target.value)
    elif isinstance(node, ast.Constant) and isinstance(node.value, int):
        for step in (1, -1):
            yield f"{node.value} -> {node.value + step}", lambda target, step=step: setattr(
                target, "value", target.value + step)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
        other = {"max": "min", "min": "max"}[node.func.id]
        yield f"{node.func.id} -> {other}", lambda target: setattr(target.func, "id", other)
    for field in ("body", "orelse"):
        statements = getattr(node, field, None)
        if isinstance(statements, list) and len(statements) > 1:
            for index, statement in enumerate(statements):
                if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)):
                    yield (f"line {statement.lineno}: without `{ast.unparse(statement).splitlines()[0]}`",
                           lambda target, field=field, index=index: getattr(target, field).pop(index))


def replaced(source: str, function: ast.FunctionDef, mutated: ast.FunctionDef) -> str:
    """The module's source with `function` written as `mutated`."""
    lines = source.splitlines()
    indent = " " * function.col_offset
    lines[first_line(function):function.end_lineno] = [indent + line if line else line for line in ast.unparse(mutated).splitlines()]
    return "\n".join(lines) + "\n"


def mutants(assignment: str) -> Iterator[tuple[str, str, str]]:
    """(module, where and what, the module's mutated source) for every change of the assignment's
    functions."""
    for entry in ASSIGNMENTS[assignment]:
        module, qualified = split_entry(entry)
        source, found = definitions(module)
        function = found[qualified]
        for index, node in enumerate(ast.walk(function)):
            for what, apply in changes(node):
                mutated = copy.deepcopy(function)
                apply(list(ast.walk(mutated))[index])  # the same node in the copy: walks visit in one order
                ast.fix_missing_locations(mutated)
                text = replaced(source, function, mutated)
                try:
                    compile(text, module, "exec")
                except SyntaxError:  # a body left empty, say
                    continue
                where = "" if what.startswith("line ") else f"line {node.lineno}: "
                yield module, f"{qualified} {where}{what}", text


def caught(workspace: Path, assignment: str, module: str, source: str) -> bool:
    """Whether the assignment's grader fails with the module replaced by `source` in `workspace`."""
    original = (workspace / module_file(module)).read_text()
    (workspace / module_file(module)).write_text(source)
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                              f"course/{assignment}", "--reference"], cwd=workspace, capture_output=True,
                             text=True, timeout=180)  # a grader takes a minute at most
        return run.returncode != 0
    except subprocess.TimeoutExpired:
        return True  # it ran on and on (a loop that never ends): a mistake a student would see
    finally:
        (workspace / module_file(module)).write_text(original)


def graded_in_a_free_workspace(free: queue.Queue, assignment: str, module: str, source: str) -> bool:
    workspace = free.get()
    try:
        return caught(workspace, assignment, module, source)
    finally:
        free.put(workspace)


def main(arguments: list[str]) -> int:
    chosen = assignments_asked(__doc__.split("\n\n")[0], "whose functions to mutate", arguments)
    with tempfile.TemporaryDirectory() as work:
        workspaces = [Path(work) / f"copy{i}" for i in range(2)]
        for workspace in workspaces:
            shutil.copytree(ROOT, workspace, ignore=NOT_COPIED)
        free = queue.Queue()
        for workspace in workspaces:
            free.put(workspace)
        total = killed = 0
        for assignment in chosen:
            cases = list(mutants(assignment))
            with ThreadPoolExecutor(max_workers=len(workspaces)) as pool:
                results = list(pool.map(lambda case: graded_in_a_free_workspace(free, assignment, case[0], case[2]),
                                        cases))
            survivors = [what for (_, what, _), result in zip(cases, results) if not result]
            total, killed = total + len(cases), killed + len(cases) - len(survivors)
            print(f"{assignment}: {len(cases) - len(survivors)} of {len(cases)} mutants caught", flush=True)
            for what in survivors:
                print(f"  survived: {what}", flush=True)
        print(f"all: {killed} of {total} caught ({killed / max(total, 1):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
