# %% [markdown]
# # One guess-and-verify step of every method, on the default model
#
# Open this file in VS Code or Jupyter (each `# %%` is a cell), or run it top to bottom:
# `python course/walkthrough.py`. For each method that guesses, it does by hand what one pass of
# `decode.generate` does after the prefill, and prints each stage:
# 1. the candidate tree the drafter proposes;
# 2. the attention mask of the pass;
# 3. the model's most likely tokens after each node;
# 4. what greedy verification accepts, and why;
# 5. the KV cache before and after `keep`.
# Lookahead's whole multi-branch tree is shown on a pass that keeps a path which is not the tree's
# first nodes (so `keep` moves slots), and the draft model on a pass where its guesses are accepted.
# The last cell does one step of exact speculative sampling, every random choice printed.
# In a students' copy of the course, a cell that needs code you have not written yet says so and the
# walkthrough goes on with the next one.

# %%
import contextlib
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import torch  # noqa: E402

from programs.convert import default_model_dir  # noqa: E402
from decode import Answer, prefill, score_tree  # noqa: E402
from drafters import Pass, Request  # noqa: E402
from kv_cache import KVCache  # noqa: E402
from methods.registry import METHODS, build_drafter, default_options  # noqa: E402
from checkpoint import load_checkpoint  # noqa: E402
from sampling import Sampling  # noqa: E402
from programs.show_tree import draw_pass, visible  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from sampling import target_probs  # noqa: E402
from verify import Chance, verify_greedy, verify_speculative  # noqa: E402

torch.set_grad_enabled(False)
folder = default_model_dir()
model, tokenizer = load_checkpoint(folder, torch.float32), Tokenizer(folder)
PROMPT = ("Summarize in two sentences: The city council met on Tuesday to discuss the new park by the river. "
          "The park will have a lake, a playground and a small cafe, and the council approved the plan.")
prompt_ids = tokenizer.prompt_ids(PROMPT, raw=False)


def text(token: int) -> str:
    return f'"{visible(tokenizer.decode([token], skip_special=False))}"'


print(f"prompt: {len(prompt_ids)} tokens")

# %% [markdown]
# ## The step, stage by stage
# The prefill puts the prompt's K/V in the cache and chooses the first new token: the *root* of the
# first tree. Then each pass goes through the stages below; the walkthrough prints the first pass
# that accepts a guess (the passes before it print one line each).


# %%
def one_step(number: int, tree, cache):
    """One pass of the loop by hand, each stage printed. Returns the verdict and the final hidden states
    and logits of every input."""
    start = cache.length
    print(f"\n1. the tree: {len(tree)} nodes (node: token, parent, depth)")
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        print(f"   {node:2}: {text(token):16} parent {parent:2}  depth {tree.depths[node]}")
    if tree.extra:
        print(f"   and {len(tree.extra)} extra inputs (PPD's soft tokens), after the nodes")

    mask = tree.input_mask(start)  # 2. every row sees the cache, then its ancestors
    print(f"\n2. the mask over the pass's inputs (each row also sees all {start} cached tokens); "
          f"positions {tree.input_positions(start).tolist()}")
    for row in mask[:, start:]:
        print("   " + " ".join("#" if seen else "." for seen in row.tolist()))

    hidden = score_tree(model, cache, tree)  # 3. one forward pass over every input
    logits = model.logits(hidden)
    nodes = logits[:len(tree)]
    probs = torch.softmax(nodes, dim=-1)
    print("\n3. the model's three most likely next tokens after each node")
    for node in range(len(tree)):
        top = probs[node].topk(3)
        print(f"   {node:2} {text(tree.tokens[node]):16} -> "
              + ", ".join(f"{text(t)} {p:.2f}" for p, t in zip(top.values.tolist(), top.indices.tolist())))

    verdict = verify_greedy(tree, nodes)  # 4. greedy verification
    choices = nodes.argmax(-1).tolist()
    print(f"\n4. verification: accepted path {verdict.path}, new tokens "
          f"{' '.join(text(t) for t in verdict.tokens)} (the last is the bonus token)")
    for node in range(1, len(tree)):
        parent, token = tree.parents[node], tree.tokens[node]
        if parent in verdict.path:
            why = ("= the model's choice after its parent: accepted" if node in verdict.path
                   else f"!= the model's choice {text(choices[parent])} after node {parent}: rejected"
                   if token != choices[parent] else "right too, but another branch went deeper")
            print(f"   node {node} {text(token)} {why}")
    done = Pass(tree, start, verdict.path, verdict.tokens, hidden, logits, verdict)
    print(draw_pass(number, done, tokenizer.decode))

    print(f"\n5. the cache holds {cache.length} slots: {start} cached + {cache.length - start} of this pass")
    path_keys = cache.keys[0, 0, 0, [start + n for n in verdict.path]].clone()  # layer 0, K/V head 0
    cache.keep(start, verdict.path)  # only the accepted path's K/V stay, moved down after the cache
    moved = torch.equal(cache.keys[0, 0, 0, start:cache.length], path_keys)
    print(f"   after keep(start={start}, path={verdict.path}): {cache.length} slots; the path's keys now "
          f"sit in slots {start}..{cache.length - 1}: {moved}")
    return done


def accepts_a_guess(done) -> bool:
    return done.verdict.accepted_guesses > 0


def keeps_a_path_that_is_not_a_prefix(done) -> bool:  # keep must move slots down
    return done.path != list(range(len(done.path)))


def as_far_as_written(step):
    """Run the cell's step; in a students' copy, name the assignment a NotImplementedError came from."""
    def run(*args, **options) -> None:
        try:
            step(*args, **options)
        except NotImplementedError as unwritten:  # "a4_greedy_loop: implement verify_greedy"
            print(f"\n=============== {args[0] if args else step.__name__}: not run yet, it needs {unwritten}")
    return run


@as_far_as_written
def walk(method_name: str, wanted=accepts_a_guess, max_passes: int = 24, **options) -> None:
    """Decode with the method until a pass is `wanted`; print that pass stage by stage."""
    drafter = build_drafter(METHODS[method_name], default_options(**options), model, tokenizer)
    cache = KVCache.for_model(model, capacity=len(prompt_ids) + 2 * max_passes * (1 + drafter.max_extra_inputs))
    drafter.begin(Request(prompt_ids, cache=cache))
    done = prefill(model, cache, drafter.prefill_tree(prompt_ids), Sampling(), None, Answer(10**6, 10**6, set()))
    drafter.after_pass(done)
    print(f"\n=============== {method_name}: the prefill chose {text(done.emitted[0])}; {cache.length} tokens cached")
    for number in range(1, max_passes + 1):
        tree = drafter.propose()
        with contextlib.redirect_stdout(io.StringIO()) as stages:  # shown if the pass accepts a guess
            done = one_step(number, tree, cache)
        drafter.after_pass(done)
        verdict = done.verdict
        if wanted(done) or number == max_passes:
            print(f"\npass {number}, root {text(tree.tokens[0])}:" + stages.getvalue())
            return
        print(f"pass {number}: {tree.draft_size} guesses, {verdict.accepted_guesses} accepted; new tokens "
              + " ".join(text(t) for t in verdict.tokens))


# %% [markdown]
# Every method with `--fixed-size` (the paper's whole tree every pass), so that what you see is the
# same on every machine: cost-aware drafting, decode.py's default, would first measure this
# machine's L(n) and then cut the trees to what pays on it (on a 2-core CPU, Lookahead's to its
# likeliest branch; the self-draft (the model's first 4 layers) and Medusa's heads would stop
# guessing at all, as they are rarely right).

# %%
walk("anpd", fixed_size=True)
walk("lookahead", keeps_a_path_that_is_not_a_prefix, fixed_size=True)
walk("speculative", fixed_size=True)
walk("medusa", fixed_size=True)
walk("ppd", fixed_size=True)


# %% [markdown]
# ## One step of exact speculative sampling
# At temperature 0.8 the draft samples each guess x from its own distribution q; the model's pass
# gives p. Walking down the chain, x is accepted with probability min(1, p(x) / q(x)); at the first
# rejection, p becomes the residual norm(max(0, p - q)), and the bonus token is drawn from what is
# left (verify.py's module docstring proves that every token then follows p exactly).


# %%
class NarratedChance(Chance):
    """verify.py's random choices, each printed as it is made."""

    def accept(self, probability) -> bool:
        accepted = super().accept(probability)
        print(f"   accept with probability min(1, p'(x) / q(x)) = {min(1.0, float(probability)):.3f}: "
              + ("accepted" if accepted else "rejected"))
        return accepted

    def draw(self, probs: torch.Tensor) -> int:
        token = super().draw(probs)
        top = probs.topk(3)
        print("   the bonus token is drawn from p' (" + ", ".join(
            f"{text(t)} {q:.2f}" for q, t in zip(top.values.tolist(), top.indices.tolist())) + f"): {text(token)}")
        return token


@as_far_as_written
def sampling_step(seed: int = 0) -> None:
    sampling, generator = Sampling(temperature=0.8), torch.Generator().manual_seed(seed)
    drafter = build_drafter(METHODS["speculative"], default_options(fixed_size=True), model, tokenizer)
    cache = KVCache.for_model(model, capacity=len(prompt_ids) + 1 + drafter.max_extra_inputs)
    drafter.begin(Request(prompt_ids, sampling, generator, cache=cache))
    done = prefill(model, cache, drafter.prefill_tree(prompt_ids), sampling, generator, Answer(10**6, 10**6, set()))
    drafter.after_pass(done)
    tree = drafter.propose()  # a chain, each guess sampled from q (tree.draft_probs)
    probs = target_probs(model.logits(score_tree(model, cache, tree))[:len(tree)], sampling)  # p after each node
    print(f"\n=============== exact speculative sampling: root {text(tree.tokens[0])}, the draft's guesses")
    for node in range(1, len(tree)):
        token, parent = tree.tokens[node], tree.parents[node]
        print(f"   {node}: {text(token):16} p = {float(probs[parent, token]):.3f} (the model, after node {parent}), "
              f"q = {float(tree.draft_probs[node, token]):.3f} (the draft)")
    print("verification, choice by choice:")
    verdict = verify_speculative(tree, probs, NarratedChance(generator))
    print(f"new tokens: {' '.join(text(t) for t in verdict.tokens)} ({verdict.accepted_guesses} accepted guesses)")


sampling_step()
