"""`decode.py --show-tree`: each forward pass's candidate tree, drawn in the terminal.

One pass of the loop (decode.py) scores a tree of guesses rooted at the last chosen token; the
verifier walks down from the root while each guess is the model's own choice at its parent (greedy;
sampling accepts by chance, verify.py) and adds a bonus token at the end of the walk. Drawn one node
per line, indented under its parent, in the order the nodes are laid out in the pass:

    pass 3: 6 guesses after 57 cached tokens, 2 accepted + the bonus token
    " the"                root: the last chosen token
    ├── ✓ " city"
    │   ├── ✓ " council"
    │   │   └── ✗ " met"  model's top: " voted"
    │   └── ✗ " hall"     model's top: " council"
    └── ✗ " town"         model's top: " city"
        └── · " hall"
    bonus " voted"
    → " city council voted"

✓ accepted (green on a terminal), ✗ rejected: the walk reached its parent and did not go on to it
(red), · unreached: an ancestor was rejected (dim). A node that carries soft tokens (PPD's prompt
tokens, ppd.py) has a dotted line for them: their outputs are the next pass's guesses.
"""

import unicodedata

from decode import Pass

ACCEPTED, REJECTED, UNREACHED = "✓", "✗", "·"
COLOURS = {"accepted": "\x1b[32m", "rejected": "\x1b[31m", "unreached": "\x1b[2m", "bonus": "\x1b[1;36m"}
RESET = "\x1b[0m"
MARKS = {"accepted": ACCEPTED, "rejected": REJECTED, "unreached": UNREACHED}


def visible(text: str, space: str = " ") -> str:
    """A token's text with its invisible characters shown: newline ↵, tab ⇥, any other control
    character as \\xNN, and, for figures, each space as `space` (␣)."""
    return "".join("↵" if ch == "\n" else "⇥" if ch == "\t" else space if ch == " "
                   else f"\\x{ord(ch):02x}" if unicodedata.category(ch) == "Cc" else ch for ch in text)


def quoted(text: str) -> str:
    return f'"{visible(text)}"'


def draw_pass(number: int, step: Pass, text_of, colour: bool = False) -> str:
    """The tree of one pass as lines of text; text_of(ids) -> the text of those token ids."""
    tree, verdict = step.tree, step.verdict
    outcomes = step.outcomes()

    def paint(text: str, kind: str) -> str:
        return f"{COLOURS[kind]}{text}{RESET}" if colour else text

    rows = []  # (left, note, kind) per node line

    def walk(node: int, indent: str) -> None:
        below = tree.children[node]
        soft = soft_tokens_line(tree, node)
        for i, child in enumerate(below):
            last = i == len(below) - 1 and not soft
            outcome = outcomes[child]
            text = quoted(text_of([tree.tokens[child]]))
            note = ""
            if outcome == "rejected":
                top = step.choices[tree.parents[child]]
                note = "model's top: " + ("the same token, not taken" if top == tree.tokens[child]
                                          else quoted(text_of([top])))
            rows.append((indent + ("└── " if last else "├── ") + MARKS[outcome] + " " + text, note, outcome))
            walk(child, indent + ("    " if last else "│   "))
        if soft:
            rows.append((indent + "└┄┄ " + soft, "", ""))

    walk(0, "")
    width = max((len(left) for left, note, _ in rows if note), default=0)
    accepted = verdict.accepted_guesses
    lines = [f"pass {number}: {tree.draft_size} guesses after {step.cache_length} cached tokens, "
             f"{accepted} accepted" + (" + the bonus token" if step.bonus_emitted else ", then the answer ended"),
             f"{quoted(text_of([tree.tokens[0]]))}  (root: the last chosen token)"]
    for left, note, kind in rows:
        line = f"{left:<{width}}  {note}".rstrip() if note else left
        lines.append(paint(line, kind) if kind else line)
    if step.bonus_emitted:
        lines.append(paint(f"bonus {quoted(text_of([verdict.tokens[-1]]))}", "bonus"))
    lines.append("→ " + quoted(text_of(step.emitted)))
    return "\n".join(lines)


def soft_tokens_line(tree, node: int) -> str:
    """The extra inputs hung on `node` (PPD's soft tokens), by their distances and copies."""
    offsets = [tree.extra.offset[row - len(tree)] for row in tree.extra_rows(node)]
    if not offsets:
        return ""
    count = len(set(offsets))
    copies = f", ×{len(offsets) // count} ensemble copies" if len(offsets) > count else ""
    distances = " ".join(f"+{d}" for d in range(1, count + 1))
    return f"{count} soft token{'s' if count > 1 else ''} ({distances}{copies}): guesses for the next pass"


class TreePrinter:
    """An `on_pass` watcher for decode.generate: draws the first `limit` passes of each answer."""

    def __init__(self, tokenizer, limit: int, colour: bool, out):
        self.tokenizer, self.limit, self.colour, self.out = tokenizer, limit, colour, out
        self.passes = 0

    def text_of(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=False)

    def __call__(self, step: Pass) -> None:
        self.passes += 1
        if self.passes <= self.limit:
            print(draw_pass(self.passes, step, self.text_of, self.colour) + "\n", file=self.out, flush=True)
