"""Starters and the students' copy, cut from the reference code by assignments.py's table.

    python course/strip.py                          # (re)write every course/<assignment>/starter.py
    python course/strip.py hide DIR --through A     # the students' copy for assignment A (a folder name,
                                                    # default the first): see hide()

A stub keeps the reference's signature and docstring, word for word, and raises NotImplementedError.
A starter stubs a function as a function, and a method as a method of a subclass of the reference
class, so everything else the class does still works. `hide` replaces the same bodies in the copy's
own modules by calls of the student's starter code: students cannot read the answers, and the whole
project (decode.py, the walkthrough, the graders) runs on their code as far as it is written.
"""

import argparse
import ast
import builtins
import importlib
import inspect
import shutil
import sys
from collections import defaultdict
from pathlib import Path

COURSE = Path(__file__).resolve().parent
ROOT = COURSE.parent
sys.path[:0] = [str(ROOT), str(COURSE)]

from assignments import ASSIGNMENTS, graded_modules, module_file, split_entry  # noqa: E402


def definitions(module: str) -> tuple[str, dict[str, ast.AST]]:
    """The module's source and its functions and methods by qualified name ("f", "Class.method")."""
    source = (ROOT / module_file(module)).read_text()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found |= {f"{node.name}.{item.name}": item for item in node.body if isinstance(item, ast.FunctionDef)}
    return source, found


def first_line(function: ast.FunctionDef) -> int:
    """The index of the function's first source line, its decorators included."""
    return min([d.lineno for d in function.decorator_list] + [function.lineno]) - 1


def stub(source: str, function: ast.FunctionDef, assignment: str) -> str:
    """The function's decorators, header and docstring as written, then a NotImplementedError body."""
    lines = source.splitlines()
    first = first_line(function)
    docstring = function.body[0]
    if not (isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)):
        raise SystemExit(f"{function.name} has no docstring: a stub needs one")
    body_indent = " " * function.body[0].col_offset
    return "\n".join(lines[first:docstring.end_lineno]
                     + [f'{body_indent}raise NotImplementedError("{assignment}: implement {function.name}")'])


def names_used(function: ast.FunctionDef, whole: bool = False) -> set[str]:
    """Names the signature needs at definition time (annotations and defaults), or with `whole` every
    name the function reads."""
    if whole:
        return {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    parts = [*function.args.defaults, *[d for d in function.args.kw_defaults if d], function.returns,
             *[a.annotation for a in [*function.args.args, *function.args.kwonlyargs] if a.annotation]]
    return {n.id for part in parts if part is not None for n in ast.walk(part) if isinstance(n, ast.Name)}


def starter(assignment: str, answered: bool = False) -> str:
    """The text of course/<assignment>/starter.py; `answered`: with the reference's bodies pasted in, as
    a student who solved it would hand it in (the instructor's dry run, dry_run.py)."""
    by_module = defaultdict(list)
    for entry in ASSIGNMENTS[assignment]:
        module, qualified = split_entry(entry)
        by_module[module].append(qualified)
    imports, from_names, blocks = set(), defaultdict(set), []
    for module, qualified_names in by_module.items():
        source, found = definitions(module)
        loaded = importlib.import_module(module)
        classes = defaultdict(list)
        for qualified in qualified_names:
            function = found[qualified]
            for name in sorted(names_used(function, whole=answered) - set(dir(builtins))):
                if not hasattr(loaded, name):
                    continue  # a local variable of the body
                value = getattr(loaded, name)
                if inspect.ismodule(value):
                    imports.add(f"import {value.__name__}" if value.__name__ == name
                                else f"import {value.__name__} as {name}")
                else:  # from where it is defined: collections.abc's Sequence, not drafters'
                    from_names[getattr(value, "__module__", None) or module].add(name)
            text = whole(source, function) if answered else stub(source, function, assignment)
            if "." in qualified:
                classes[qualified.split(".")[0]].append(text)
                imports.add(f"import {module}")
            else:
                blocks.append(text)
        for cls, methods in classes.items():
            from_names[module].discard(cls)  # the subclass below is the class its methods name
            blocks.append(f"class {cls}({module}.{cls}):\n" + "\n\n".join(methods))
    doc = (f'"""Assignment {assignment}: your code (see handout.md). Each stub below has the reference\'s\n'
           f'signature and docstring; replace its NotImplementedError with your implementation, then run\n\n'
           f'    python -m pytest course/{assignment}\n"""')
    imports |= {f"from {source} import {', '.join(sorted(names))}" for source, names in from_names.items() if names}
    header = doc + ("\n\n" + "\n".join(sorted(imports)) if imports else "")
    return header + "\n\n\n" + "\n\n\n".join(blocks) + "\n"


def whole(source: str, function: ast.FunctionDef) -> str:
    """The function as the reference writes it, decorators included."""
    return "\n".join(source.splitlines()[first_line(function):function.end_lineno])


def released(assignment: str) -> str:
    """course/<assignment>/starter.py once the assignment's answers are out: the project's own code."""
    by_module = defaultdict(list)
    for name, module in graded_modules(assignment).items():
        by_module[module].append(name)
    imports = "\n".join(f"from {module} import {', '.join(names)}  # noqa: F401" for module, names in by_module.items())
    return (f'"""Assignment {assignment}: released. Its answers are the project\'s own code now; your\n'
            f'later assignments build on them."""\n\n{imports}\n')


def forwarded(function: ast.FunctionDef) -> str:
    """The call that passes a function's own parameters on, as they came: "f(a, b, *args, c=c)"."""
    a = function.args
    parts = [arg.arg for arg in [*a.posonlyargs, *a.args]]
    parts += [f"*{a.vararg.arg}"] if a.vararg else []
    parts += [f"{arg.arg}={arg.arg}" for arg in a.kwonlyargs]
    parts += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return f"{function.name}({', '.join(parts)})"


def hidden(module: str, entries: list[tuple[str, str]]) -> str:
    """The module's source with each (qualified name, assignment)'s body replaced by a call of the
    student's code in that assignment's starter.py (docstrings kept)."""
    source, found = definitions(module)
    lines = source.splitlines()
    for qualified, assignment in sorted(entries, key=lambda e: -found[e[0]].lineno):  # bottom up
        function = found[qualified]
        indent = " " * function.body[0].col_offset
        owner = qualified.split(".")[0] + "." if "." in qualified else ""
        lines[function.body[0].end_lineno:function.end_lineno] = [
            f"{indent}return yours(\"{assignment}\").{owner}{forwarded(function)}"]
    last_import = max(node.end_lineno for node in ast.parse(source).body if isinstance(node, (ast.Import, ast.ImportFrom)))
    lines.insert(last_import, "from course_starters import yours  # this copy runs the student's code (course/README.md)")
    return "\n".join(lines) + "\n"


STARTER_LOADER = '''"""The students' copy of the course: the project's functions that are assignments call the student's
code in course/<assignment>/starter.py (written by course/strip.py hide)."""

import functools
import importlib.util
from pathlib import Path


@functools.cache
def yours(assignment: str):
    path = Path(__file__).resolve().parent / "course" / assignment / "starter.py"
    spec = importlib.util.spec_from_file_location(f"{assignment}_starter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
'''


NO_MISTAKES = '''"""The planted mistakes are the instructor's: each is one change away from a solution, so the
students' copy ships none (`python -m pytest course --mistake NAME` runs in the instructor's copy)."""

MISTAKES = {}
'''


NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
                                    ".gpu", "figures")  # the repository's history, caches and outputs


def hide(destination: Path, through: str | None = None) -> None:
    """A students' copy of the project for assignment `through` (default: the first, so every
    assignment is the student's to write).

    The assignments before it are released: their reference code stays in the copy's modules and
    their starters import it. From `through` on, every assignment's reference body is replaced by a
    call of the student's starter (whose stubs raise NotImplementedError until written), so the copy
    holds no answer the student has yet to give, and no assignment's grader runs a later one's code
    (course/dry_run.py checks that, assignment by assignment). The instructor's tools stay out: the
    planted mistakes (each one change from an answer), their proof, strip.py and dry_run.py (which,
    run in the copy, would overwrite the student's starters) and mutants.py.
    """
    names = list(ASSIGNMENTS)
    through = through or names[0]
    if through not in ASSIGNMENTS:
        raise SystemExit(f"error: --through {through!r} is not an assignment: {', '.join(names)}")
    if destination.exists():
        raise SystemExit(f"error: {destination} exists; give a new folder")
    shutil.copytree(ROOT, destination, ignore=NOT_COPIED)
    current = names.index(through)
    by_module = defaultdict(list)
    for assignment in names[current:]:
        for entry in ASSIGNMENTS[assignment]:
            module, qualified = split_entry(entry)
            by_module[module].append((qualified, assignment))
    for module, entries in by_module.items():
        (destination / module_file(module)).write_text(hidden(module, entries))
    for assignment in names[:current]:
        (destination / "course" / assignment / "starter.py").write_text(released(assignment))
    (destination / "course_starters.py").write_text(STARTER_LOADER)
    (destination / "course" / "mistakes.py").write_text(NO_MISTAKES)
    for instructors_only in ["tests/test_course.py", "course/strip.py", "course/dry_run.py", "course/mutants.py"]:
        (destination / instructors_only).unlink()
    print(f"students' copy for {through} in {destination}: {', '.join(names[:current]) or 'no assignment'} "
          f"released, {sum(map(len, by_module.values()))} bodies of {', '.join(names[current:])} call the starters")


def main(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="[hide]")
    hide_parser = commands.add_parser("hide", help="write a students' copy of the project")
    hide_parser.add_argument("destination", type=Path, help="a new folder for the copy")
    hide_parser.add_argument("--through", metavar="ASSIGNMENT", choices=list(ASSIGNMENTS),
                             help=f"the assignment handed out: the ones before it are released, it and the later "
                                  f"ones are stubs (one of {', '.join(ASSIGNMENTS)}; default: the first)")
    options = parser.parse_args(arguments)
    if options.command == "hide":
        hide(options.destination, options.through)
    else:
        for name in ASSIGNMENTS:
            (COURSE / name).mkdir(exist_ok=True)
            (COURSE / name / "starter.py").write_text(starter(name))
            print(f"course/{name}/starter.py")


if __name__ == "__main__":
    main(sys.argv[1:])
