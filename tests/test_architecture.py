"""The shape of the code, checked: the modules import each other without a cycle, lowest first; no
module imports one of ours inside a function; nothing points a reader outside the repository; and the
decoding loop's body is steps, counted in one visible line; at most seven import layers; the
reference core imports no backend, and no run loads one it did not ask for.

Run it as a script to print the import layers:  python tests/test_architecture.py
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["backends", "methods", "training", "programs"]  # packages, by concern
MODULES = {path.stem: path for path in sorted(ROOT.glob("*.py"))} | {
    (folder if path.stem == "__init__" else f"{folder}.{path.stem}"): path
    for folder in FOLDERS for path in sorted((ROOT / folder).glob("*.py"))}

# the reference core: what a reader steps through, plain PyTorch (errors: the one exception a user's
# mistake raises, which the programs print as one line)
CORE = {"decode", "model", "kv_cache", "tree", "verify", "sampling", "drafters"}
CORE_MAY_IMPORT = CORE | {"errors", "torch", "numpy"}

TIERS = [  # a module may import modules of its own tier or lower ones, never higher ones
    ["errors", "programs", "programs.progress", "programs.staging", "programs.convert", "programs.bench_data",
     "programs.lists_due", "programs.charts", "model", "kv_cache", "tree", "sampling", "tokenizer",
     "checkpoint"],  # foundations: the model, its parts, and files, data and progress
    ["verify", "drafters", "decode"],  # the guess-and-verify loop and its guessers: the reference core
    ["methods", "methods.latency", "methods.cost_aware", "methods.artifacts", "methods.recycling", "methods.medusa", "methods.eagle",
     "methods.ppd", "methods.combined", "methods.apar", "methods.apar_quality", "training", "training.self_distill",
     "training.apar_finetune", "programs.prompts"],  # the other methods, their training, and their parts
    ["backends", "backends.cpu_kernels", "backends.cpu_bfloat16", "backends.cuda_graphs", "backends.cpu_compiled",
     "backends.cpu_fused"],  # the speed engines, applied from outside
    ["calibrate", "methods.registry", "programs.show_tree"],  # what sizes and builds a method; the loop drawn
    ["programs.cli", "bench", "train_prompt", "visualize"],  # the programs
]
STUDENTS_COPY_ONLY = {"course_starters"}  # written by `course/strip.py hide`: it loads the student's starters
TIER = {module: tier for tier, modules in enumerate(TIERS) for module in modules} | dict.fromkeys(STUDENTS_COPY_ONLY, 0)


def is_main_block(node) -> bool:
    """`if __name__ == "__main__":`, which runs a module as a script and never runs on import."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def imported_names(node) -> list[str]:
    """The modules an import statement names: `backends.cpu_fused` for `from backends import cpu_fused`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def ours(name: str) -> str | None:
    """The module of ours `name` is (or is in), if any."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, keep=ours) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside a function or class), as `keep` names
    them (ours: our modules only)."""
    tree = ast.parse(MODULES[module].read_text())
    top, nested = set(), set()
    for node in tree.body:
        if is_main_block(node):
            continue
        top |= {keep(name) for name in imported_names(node)} - {None}
        for inner in ast.walk(node):
            if inner is not node:
                nested |= {keep(name) for name in imported_names(inner)} - {None}
    return top - {module}, nested - {module}


def layers() -> list[list[str]]:
    """Modules in layers: each imports only modules of lower layers. Raises on a cycle."""
    graph = {module: imports(module)[0] - STUDENTS_COPY_ONLY for module in MODULES if module not in STUDENTS_COPY_ONLY}
    placed, result = set(), []
    while len(placed) < len(graph):
        layer = sorted(m for m, deps in graph.items() if m not in placed and deps <= placed)
        if not layer:
            cycle = sorted(m for m in graph if m not in placed)
            raise AssertionError(f"import cycle among {cycle}")
        result.append(layer)
        placed |= set(layer)
    return result


def test_the_import_graph_has_no_cycle():
    assert sum(map(len, layers())) == len(set(MODULES) - STUDENTS_COPY_ONLY)


def test_the_import_graph_is_shallow():
    """At most seven layers: a reader following imports down from a program reaches the foundations in
    six steps (python tests/test_architecture.py prints them)."""
    assert len(layers()) <= 7, layers()


def test_every_module_imports_only_its_own_tier_or_lower_ones():
    assert set(MODULES) <= set(TIER) and set(TIER) - set(MODULES) <= STUDENTS_COPY_ONLY, "place every module in a tier"
    upward = {(module, dep) for module in MODULES for dep in imports(module)[0] if TIER[dep] > TIER[module]}
    assert upward == set()


def test_no_module_imports_one_of_ours_inside_a_function():
    nested = {module: imports(module)[1] for module in MODULES}
    assert {module: found for module, found in nested.items() if found} == {}


def test_nothing_points_a_reader_outside_the_repository():
    for path in [*MODULES.values(), ROOT / "README.md", *sorted((ROOT / "tests").glob("*.py"))]:
        text = path.read_text()
        if path.name == "test_architecture.py":
            continue
        assert "../shared" not in text and "DESIGN.md" not in text, path.name


def test_every_module_says_what_it_is():
    for module, path in MODULES.items():
        assert ast.get_docstring(ast.parse(path.read_text())), f"{module}.py has no docstring"


def test_the_decoding_loop_is_steps_with_one_visible_count():
    """decode.generate's while body fits on a screen, reads no clock (the meter's `with
    meter.time(phase):` names a phase; the meter reads the clock) and counts in one visible line,
    `counts.add_pass(...)`, with no `+=` tallies scattered through it."""
    tree = ast.parse(MODULES["decode"].read_text())
    generate = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "generate")
    loop = next((n for n in ast.walk(generate) if isinstance(n, ast.While)), None)
    if loop is None and "course_starters" in MODULES:
        pytest.skip("in the students' copy, generate is the student's (course/a4_greedy_loop/starter.py)")
    assert loop.end_lineno - loop.lineno <= 25
    counted = []
    for node in ast.walk(loop):
        assert not isinstance(node, ast.AugAssign), f"a tally in the loop, line {node.lineno}"
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            assert called not in ("perf_counter", "monotonic", "now", "elapsed"), f"a clock in the loop, line {node.lineno}"
            counted += [node.lineno] if called == "add_pass" else []
    assert len(counted) == 1, f"the loop must count each pass in one line, not at lines {counted}"


def test_the_core_imports_torch_numpy_and_itself_only():
    """decode, model, kv_cache, tree, verify, sampling and drafters: plain PyTorch a reader can step
    through; no backend, no method, no program (the standard library aside)."""
    for module in CORE:
        top, nested = imports(module, keep=lambda name: name.split(".")[0])
        found = {name for name in top | nested if name in CORE_MAY_IMPORT or ours(name) or name in ("numba", "llvmlite")}
        assert found <= CORE_MAY_IMPORT | STUDENTS_COPY_ONLY, (module, found - CORE_MAY_IMPORT)


def test_importing_the_core_or_the_command_line_loads_no_backend():
    """numba, llvmlite and the backends load only when a run asks for a backend (backends.apply)."""
    probe = ("import sys, decode, model, verify, drafters, tree, kv_cache, sampling; core = set(sys.modules); "
             "import programs.cli, methods.registry; print(sorted(m for m in ('numba', 'llvmlite', 'backends.cpu_kernels', "
             "'backends.cpu_fused', 'backends.cpu_compiled', 'backends.cuda_graphs') if m in core), "
             "sorted(m for m in ('numba', 'llvmlite', 'backends.cpu_kernels') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["[]", "[]"], done.stdout + done.stderr


def test_a_backend_is_named_in_one_place_and_imported_only_when_asked_for():
    """Only backends/__init__.py names a backend's module for a run (bench.py, which measures their
    kernels, and the backends themselves aside)."""
    allowed = {"bench", "backends"} | {m for m in MODULES if m.startswith("backends.")}
    importers = {module for module in MODULES for dep in imports(module)[0]
                 if dep.startswith("backends.") and module not in allowed}
    assert importers == set()


def test_at_most_fifteen_python_files_at_the_top_and_every_folder_says_what_it_holds():
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= 15, top
    for folder in FOLDERS:
        assert ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())), f"{folder}/ says nothing"


if __name__ == "__main__":
    for depth, layer in enumerate(layers()):
        print(f"{depth}: {' '.join(layer)}")
    sys.exit(0)
