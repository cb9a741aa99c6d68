"""decode.py --show-tree (show_tree.py): a hand-built tree drawn exactly as expected, every node of any
tree drawn once under its parent with the verifier's verdict, and the command line's trees."""

import torch
from hypothesis import given, strategies as st

from programs.cli import main
from helpers import VOCAB_OF_TREES, cheap, trees
from decode import Pass
from programs.show_tree import ACCEPTED, REJECTED, UNREACHED, draw_pass
from methods.ppd import soft_layout
from tree import Tree
from verify import verify_greedy

WORDS = ["the", " city", " council", " met", " hall", " town", " voted"]
THE, CITY, COUNCIL, MET, HALL, TOWN, VOTED = range(len(WORDS))


def text_of(ids):
    return "".join(WORDS[i] for i in ids)


def greedy_pass(tree: Tree, choices: list[int], vocab: int, cache_length: int = 57) -> Pass:
    """The pass a model whose most likely token after node i is choices[i] makes of `tree`, judged by
    the real greedy verifier."""
    logits = torch.zeros(tree.input_count, vocab)
    logits[range(len(tree)), choices] = 1.0
    verdict = verify_greedy(tree, logits)
    return Pass(tree, cache_length, verdict.path, verdict.tokens, torch.zeros(tree.input_count, 1), logits, verdict)


def test_a_hand_built_tree_is_drawn_as_expected():
    #            0     1      2         3     4      5      6
    tree = Tree([THE, CITY, COUNCIL, MET, HALL, TOWN, HALL], [-1, 0, 1, 2, 1, 0, 5])
    step = greedy_pass(tree, [CITY, COUNCIL, VOTED, THE, THE, THE, THE], len(WORDS))
    assert step.verdict.path == [0, 1, 2] and step.verdict.tokens == [CITY, COUNCIL, VOTED]
    assert draw_pass(3, step, text_of) == "\n".join([
        'pass 3: 6 guesses after 57 cached tokens, 2 accepted + the bonus token',
        '"the"  (root: the last chosen token)',
        '├── ✓ " city"',
        '│   ├── ✓ " council"',
        '│   │   └── ✗ " met"  model\'s top: " voted"',
        '│   └── ✗ " hall"     model\'s top: " council"',
        '└── ✗ " town"         model\'s top: " city"',
        '    └── · " hall"',
        'bonus " voted"',
        '→ " city council voted"',
    ])


def test_colour_marks_accepted_rejected_and_unreached_lines():
    tree = Tree([THE, CITY, MET, TOWN], [-1, 0, 0, 2])
    lines = draw_pass(1, greedy_pass(tree, [CITY, THE, THE, THE], len(WORDS)), text_of, colour=True).splitlines()
    assert lines[2].startswith("\x1b[32m") and ACCEPTED in lines[2]  # " city", green
    assert lines[3].startswith("\x1b[31m") and REJECTED in lines[3]  # " met", red
    assert lines[4].startswith("\x1b[2m") and UNREACHED in lines[4]  # " town" under it, dim


def test_soft_tokens_and_a_bonus_cut_by_the_stop_rule():
    tree = Tree([THE, CITY, TOWN], [-1, 0, 0]).with_extra(soft_layout([2, 1, 0], ensembles=2))
    step = greedy_pass(tree, [CITY, VOTED, THE], len(WORDS))
    step.emitted = [CITY]  # the answer ended at " city": the bonus " voted" was never emitted
    drawn = draw_pass(1, step, text_of)
    assert drawn.splitlines()[2:6] == [
        '├── ✓ " city"',
        '│   └┄┄ 1 soft token (+1, ×2 ensemble copies): guesses for the next pass',
        '├── ✗ " town"  model\'s top: " city"',
        '└┄┄ 2 soft tokens (+1 +2, ×2 ensemble copies): guesses for the next pass',
    ]
    assert "\nbonus" not in drawn and drawn.endswith('→ " city"') and "then the answer ended" in drawn


@cheap
@given(trees(), st.data())
def test_every_node_is_drawn_once_at_its_depth_with_the_verdicts_mark(tree, data):
    choices = data.draw(st.lists(st.integers(0, VOCAB_OF_TREES - 1), min_size=len(tree), max_size=len(tree)))
    step = greedy_pass(tree, choices, VOCAB_OF_TREES)
    node_lines = draw_pass(1, step, lambda ids: "".join(f"<{i}>" for i in ids)).splitlines()[2:len(tree) + 1]
    marks = {"accepted": ACCEPTED, "rejected": REJECTED, "unreached": UNREACHED}
    depth_first = []  # the nodes in the order they should be drawn: depth first, children in layout order

    def visit(node):
        for child in tree.children[node]:
            depth_first.append(child)
            visit(child)
    visit(0)
    assert len(node_lines) == len(depth_first)
    for node, line in zip(depth_first, node_lines):
        mark = marks[step.outcomes()[node]]
        assert line.index(mark) == 4 * tree.depths[node], line  # "│   " per ancestor below the root, then "├── "
        assert line[line.index(mark) + 2:].startswith(f'"<{tree.tokens[node]}>"')
    assert sum(line.count(ACCEPTED) for line in node_lines) == step.verdict.accepted_guesses


def test_the_command_line_draws_the_first_n_passes_then_the_answer(capsys, tiny_folder):
    code = main(["--model", str(tiny_folder), "--raw", "--prompt", "the quick brown fox jumps over the lazy dog the",
                 "--method", "anpd", "--max-new-tokens", "12", "--show-tree", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    trees_part, answer = out.split("answer (")
    assert [line.split(":")[0] for line in trees_part.splitlines() if line.startswith("pass ")] == ["pass 1", "pass 2"]
    assert "(root: the last chosen token)" in trees_part and "→ " in trees_part
    assert "passes after the prefill):\n" in answer and answer.strip().count("\n") >= 1
