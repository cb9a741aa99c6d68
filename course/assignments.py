"""The course's assignments: what each one asks you to write, as the reference names it.

Each entry is "module.name" or "module.Class.method" in the project's own code, the module by its
dotted path ("methods.eagle" for methods/eagle.py). The assignment's
starter.py holds the same functions (and, for methods, a subclass of the reference class) with the
reference's signatures and docstrings and `raise NotImplementedError` bodies; `python course/strip.py`
writes the starters from this table, and `python course/strip.py hide DIR` writes a copy of the project
with these bodies removed for students (see course/README.md).
"""

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ASSIGNMENTS = {
    "a1_llama": ["model.rms_norm", "model.rotary_cos_sin", "model.apply_rotary", "model.grouped_attention"],
    "a2_kv_cache": ["kv_cache.KVCache.write", "kv_cache.KVCache.truncate", "kv_cache.KVCache.keep"],
    "a3_tree_mask": ["tree.Tree.positions", "tree.Tree.ancestor_mask", "tree.Tree.attention_mask"],
    "a4_greedy_loop": ["verify.verify_greedy", "verify.longest_path", "decode.generate"],
    "a5_ngrams": ["drafters.MultiLevelNGram.add", "drafters.MultiLevelNGram.query"],
    "a6_speculative_sampling": ["verify.verify_speculative", "verify.residual_after_rejection"],
    "a7_trie": ["drafters.Trie.add", "drafters.Trie.prune", "drafters.TrieDrafter.retrieve"],
    "a8_sparse_trees": ["tree.path_probability", "tree.expected_accepted", "tree.best_sparse_tree"],
    "a9_capstone": ["calibrate.calibrate"],
    "a10_eagle_trees": ["methods.eagle.DraftTree.grow", "methods.eagle.DraftTree.frontier",
                        "methods.eagle.DraftTree.best"],
}


def module_file(module: str) -> Path:
    """The file of a module named by its dotted path, relative to the project's root."""
    return Path(*module.split(".")).with_suffix(".py")


def split_entry(entry: str) -> tuple[str, str]:
    """("methods.eagle", "DraftTree.grow") for "methods.eagle.DraftTree.grow": the module is the longest
    dotted prefix that names a file of the project."""
    parts = entry.split(".")
    cut = max(i for i in range(1, len(parts)) if (ROOT / module_file(".".join(parts[:i]))).is_file())
    return ".".join(parts[:cut]), ".".join(parts[cut:])


def graded_modules(assignment: str) -> dict[str, str]:
    """The names a grader asks for, each with its module: each function, and each class once (its
    methods come with it)."""
    return {qualified.split(".")[0]: module for module, qualified in map(split_entry, ASSIGNMENTS[assignment])}


def graded_names(assignment: str) -> list[str]:
    """The names a grader asks for (graded_modules), in the table's order."""
    return list(graded_modules(assignment))


def assignments_asked(description: str, what: str, arguments: list[str]) -> list[str]:
    """The assignments a course tool's command line names (every one when it names none)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("assignments", nargs="*", metavar="ASSIGNMENT",
                        help=f"{what} (default: all of {', '.join(ASSIGNMENTS)})")
    chosen = parser.parse_args(arguments).assignments or list(ASSIGNMENTS)
    for unknown in set(chosen) - set(ASSIGNMENTS):
        parser.error(f"{unknown!r} is not an assignment: {', '.join(ASSIGNMENTS)}")
    return chosen
