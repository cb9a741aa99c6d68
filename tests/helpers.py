"""Helpers shared by the tests and the course's graders (course/): random tiny Llama checkpoints
(float64 by default, so numerical near-ties cannot flip an argmax), random trees, naive references
and the statistics the sampling checks use."""

import functools
import itertools
import json
import os
import random
import sys
import unittest.mock
import weakref
from collections import Counter
from pathlib import Path

import torch
from hypothesis import Phase, settings, strategies as st
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from methods import apar  # noqa: E402
from methods import artifacts  # noqa: E402
from decode import generate  # noqa: E402
from methods.eagle import EagleHead  # noqa: E402
from methods.medusa import MedusaDrafter, MedusaHeads  # noqa: E402
from checkpoint import build_model, config_from_hf, hf_weight_shapes, load_checkpoint  # noqa: E402
from drafters import Drafter, DraftModelDrafter, NGramDrafter, Pass, TrieDrafter, first_layers  # noqa: E402
from methods.ppd import PPDDrafter, SoftTokens, best_dynamic_sparse_tree  # noqa: E402
from tree import Tree, Verdict  # noqa: E402
from verify import Chance, verify_speculative  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
settings.register_profile("thorough", deadline=None, max_examples=500)
# For runs that need only to know which tests fail (tests/test_course.py grading the starters and the
# planted mistakes): the first failing example, not shrunk (shrinking took over half of those runs).
settings.register_profile("unshrunk", settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# For properties that cost milliseconds per example: at least 200 examples, whatever the profile (25
# let a planted mistake through once; tests/test_course.py keeps checking that the graders catch them).
cheap = settings(max_examples=max(settings.default.max_examples, 200))


def tiny_hf_config(layers=2, heads=4, kv_heads=2, head_dim=8, vocab=64, tied=False, **extra) -> dict:
    """A Hugging Face style config.json for a tiny Llama."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": heads * head_dim, "intermediate_size": 3 * heads * head_dim,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
        **extra,
    }


def random_hf_weights(hf_config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under Hugging Face names; large enough that logits are far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_weight_shapes(config_from_hf(hf_config)).items():
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            weights[name] = torch.randn(shape, generator=gen, dtype=torch.float64) * shape[-1] ** -0.5 * 2
    return weights


def random_model(hf_config: dict, seed: int = 0, dtype=torch.float64):
    return build_model(config_from_hf(hf_config), random_hf_weights(hf_config, seed), dtype)


def full_logits(model, sequence):
    """Logits at every position of a plain full forward (no cache). [len, V]"""
    tokens = torch.tensor([sequence])
    return model(tokens, positions=torch.arange(len(sequence)))[0][0]


@functools.cache
def tiny_model(seed: int = 0, *, vocab: int = 16, max_positions: int = 64, layers: int = 2):
    """The shared random tiny float64 Llama for `seed`, built once per test session for each set of
    arguments. Tests must not change it; one that needs to builds its own with random_model."""
    return random_model(tiny_hf_config(layers=layers, vocab=vocab, max_position_embeddings=max_positions), seed=seed)


def random_eagle_head(model, seed: int, draft_vocab: int) -> EagleHead:
    """An EAGLE head for the tiny float64 `model` with random weights, over a random draft vocabulary of
    `draft_vocab` tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randperm(model.config.vocab_size, generator=generator)[:draft_vocab].sort().values
    head = EagleHead(model.config, ids).double()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.3)
    return head.use_lm_head(model.lm_head)


EVERY_DRAFTER_ACCURACY = [[0.3, 0.2, 0.15, 0.1], [0.3, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.05]]


def every_drafter(model) -> dict:
    """One drafter of every lossless method for a tiny `model` (random Medusa heads and PPD soft tokens, so
    that their trees are full of guesses), on the model's device, in its dtype."""
    heads = MedusaHeads(model.config.hidden_size, 3).to(model.dtype)
    torch.manual_seed(0)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    soft = torch.randn(3, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    soft = soft.to(model.dtype)
    accuracy = EVERY_DRAFTER_ACCURACY
    return {
        "anpd": NGramDrafter(n=3, k=4),
        "lookahead": TrieDrafter(decoding_length=6, branch_length=3),
        "lookahead-parallel": TrieDrafter(decoding_length=6, branch_length=3, hierarchical=False),
        "speculative": DraftModelDrafter(first_layers(model, 1), gamma=3),
        "medusa": MedusaDrafter(model, heads.to(model.device), accuracy, inputs=8),
        "ppd": PPDDrafter(model, SoftTokens(soft.to(model.device)), best_dynamic_sparse_tree(accuracy, 12, 3, 2), accuracy),
    }


def write_checkpoint(folder: Path, hf_config: dict, seed: int = 0, weights=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    weights = random_hf_weights(hf_config, seed) if weights is None else weights
    save_file({k: v.float().contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    return folder


def tiny_artifacts(folder, out):
    """Medusa heads and PPD soft tokens (random) made for the tiny checkpoint, as train_prompt.py
    would save them."""
    model = load_checkpoint(folder, torch.float32)
    accuracy = [[0.4, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]
    heads = MedusaHeads(model.config.hidden_size, 3)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    artifacts.save(out / "medusa", heads.state_dict(), {"kind": "medusa", "heads": 3, "accuracy": accuracy,
                                                        "model": artifacts.model_fingerprint(model)})
    embeddings = torch.randn(3, 2, model.config.hidden_size)
    artifacts.save(out / "ppd", {"embeddings": embeddings}, {"kind": "ppd", "soft_tokens": 3, "ensembles": 2,
                                                             "accuracy": accuracy,
                                                             "model": artifacts.model_fingerprint(model)})


def write_tiny_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer.json trained on a few sentences; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def chi_square_p_value(counts: dict, expected: dict, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness-of-fit p-value of observed `counts` against the probabilities
    `expected` (outcome -> probability, summing to 1). Outcomes expected fewer than `min_expected`
    times are pooled into one bin, as the test's chi-square approximation needs; an outcome that
    was observed but has probability 0 gives p-value 0."""
    total = sum(counts.values())
    if any(expected.get(outcome, 0.0) == 0.0 for outcome, n in counts.items() if n):
        return 0.0
    bins, pooled_n, pooled_e = [], 0, 0.0
    for outcome, prob in expected.items():
        n, e = counts.get(outcome, 0), prob * total
        if e < min_expected:
            pooled_n, pooled_e = pooled_n + n, pooled_e + e
        else:
            bins.append((n, e))
    if pooled_e > 0:
        bins.append((pooled_n, pooled_e))
    statistic = sum((n - e) ** 2 / e for n, e in bins)
    dof = len(bins) - 1
    if dof < 1:
        return 1.0
    # the chi-square survival function is the regularised upper incomplete gamma Q(dof/2, x/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


# ---- random trees --------------------------------------------------------------------------------

TABLE_VOCAB = 3  # the exact-sampling models' vocabulary: every outcome can be enumerated
VOCAB_OF_TREES = 4  # few tokens, so guesses are often right and sibling tokens often repeat


@st.composite
def trees(draw, max_nodes=24):
    size = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, node - 1)) for node in range(1, size)]
    tokens = draw(st.lists(st.integers(0, VOCAB_OF_TREES - 1), min_size=size, max_size=size))
    return Tree(tokens, parents)


def path_to(tree: Tree, node: int) -> list[int]:
    """The nodes from the root down to `node`."""
    path = [node]
    while tree.parents[path[-1]] != -1:
        path.append(tree.parents[path[-1]])
    return path[::-1]


# ---- accuracy tables and self-distilled answers (Medusa, PPD) ------------------------------------

accuracy_tables = st.integers(1, 3).flatmap(lambda depth: st.integers(1, 3).flatmap(
    lambda ranks: st.lists(st.lists(st.floats(0.0, 1.0 / ranks), min_size=ranks, max_size=ranks),
                           min_size=depth, max_size=depth)))


def random_accuracy(rng, depth, ranks):
    return [sorted((rng.random() / ranks for _ in range(ranks)), reverse=True) for _ in range(depth)]


def wholly_float64(theirs):
    """transformers' Llama with its RMSNorms and rotary angles in float64 like the rest: it computes
    them in float32 even in a float64 model, which moved a few logits by up to 2e-4 (500-example runs
    found such cases). Each layer's formula is the paper's, as transformers writes it."""
    rotary = theirs.model.rotary_emb

    def rotary_forward(x, position_ids):
        angles = position_ids[..., None].double() * rotary.inv_freq.double()  # [B, T, E/2]
        both_halves = torch.cat([angles, angles], dim=-1)
        scale = rotary.attention_scaling
        return (both_halves.cos() * scale).to(x.dtype), (both_halves.sin() * scale).to(x.dtype)

    def rms_norm(norm):
        return lambda x: norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    rotary.forward = rotary_forward
    for module in theirs.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = rms_norm(module)
    return theirs


def transformers_logits(folder, sequence: list[int]) -> torch.Tensor:
    """[len, V]: Hugging Face transformers' Llama on the checkpoint in `folder`, wholly in float64 (an
    implementation independent of ours)."""
    import transformers

    theirs = wholly_float64(transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval())
    with torch.inference_mode():
        return theirs(torch.tensor([sequence])).logits[0]


# ---- Lookahead's trie, counted naively ---------------------------------------------------------

def trie_counts(trie):
    """{token sequence: (prompt count, output count)} for every node."""
    found = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            found[path + (token,)] = (child.prompt_count, child.output_count)
            stack.append((path + (token,), child))
    return found


def occurrences(text, depth):
    """{sequence: times it occurs in text} for every sequence of 1..depth tokens."""
    counts = {}
    for start in range(len(text)):
        for end in range(start + 1, min(start + depth, len(text)) + 1):
            counts[tuple(text[start:end])] = counts.get(tuple(text[start:end]), 0) + 1
    return counts


def assert_trie_invariants(trie):
    counts = trie_counts(trie)
    assert trie.node_count == len(counts), (
        f"node_count says {trie.node_count} nodes, but the trie holds {len(counts)} (count every node you add, "
        f"and uncount every node pruning removes)")
    for path, (prompt, output) in counts.items():
        assert prompt + output > 0, f"the node of {list(path)} counts no occurrence: a node nobody counted should be gone"
        assert len(path) <= trie.depth, f"the node of {list(path)} is deeper than the trie's depth {trie.depth}"
        if len(path) > 1:  # a sequence occurs at most as often as its prefix
            parent_prompt, parent_output = counts[path[:-1]]
            assert prompt <= parent_prompt and output <= parent_output, (
                f"{list(path)} counts (prompt, output) = ({prompt}, {output}) occurrences, more than its prefix "
                f"{list(path[:-1])} ({parent_prompt}, {parent_output}): a sequence occurs at most as often as its prefix")


requests = st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=20),
                              st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=6)),
                    min_size=1, max_size=4)


def naive_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Vanilla greedy decoding the plainest way: one full forward pass over the whole sequence per new
    token, no cache and none of the project's loop (the course's graders compare with it)."""
    sequence = list(prompt)
    for _ in range(max_new_tokens):
        sequence.append(int(full_logits(model, sequence)[-1].argmax()))
    return sequence[len(prompt):]


def assert_decodes_as_naive_greedy(generate_function, model, prompt, max_new_tokens, drafter, whose="decoding"):
    """`generate_function` (decode.generate or a student's) with `drafter` gives naive_greedy's tokens."""
    expected = naive_greedy(model, prompt, max_new_tokens)
    got = generate_function(model, prompt, max_new_tokens=max_new_tokens, eos_ids=set(), drafter=drafter).token_ids
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert got == expected, (f"prompt {prompt}: {whose} with {type(drafter).__name__} differs from vanilla greedy "
                             f"at new token {first}: {got} vs {expected}")


def scripted_apar(choose, *args, **options):
    """generate_apar with each thread's verifier replaced by `choose(logits [V], thread) -> token`
    (threads that guess nothing), to script forks and ends."""
    def verifier(control, sampling, generator, fork_bias):
        def judge(tree, logits, thread):
            assert tree.draft_size == 0, "scripted threads guess nothing"
            return Verdict.of(tree, [0], choose(logits[0], thread))
        return judge
    with unittest.mock.patch.object(apar, "verifier", verifier):
        return apar.generate_apar(*args, **options)



def tell(drafter: Drafter, tokens: list[int]) -> None:
    """Tell `drafter` what the loop tells it after a pass that guessed nothing and emitted `tokens`."""
    root = Tree.chain(drafter.history[-1], [])
    drafter.after_pass(Pass(root, len(drafter.history) - 1, [0], list(tokens), torch.zeros(1, 1), torch.zeros(1, 1)))


class WrongBranchFirst(Drafter):
    """Guesses a wrong token first and the right continuation (vanilla's answer) in a second branch, so
    the accepted path is never the tree's first nodes: the loop must keep exactly the path's K/V."""

    def __init__(self, answer: list[int], vocab: int):
        self.answer, self.vocab = answer, vocab
        self.max_extra_inputs = 4

    def propose(self):
        done = len(self.history) - self.prompt_length
        right = self.answer[done:done + 3]
        wrong = [(right[0] + 1) % self.vocab] if right else []
        return Tree.from_branches(self.history[-1], [wrong, right], budget=4)

    def begin(self, request):
        super().begin(request)
        self.prompt_length = len(request.prompt_ids)  # then the answer: its next token follows the root


class RandomGuesses(Drafter):
    """A random tree each pass, each guess right (vanilla's answer at its depth) with probability
    `right`: chains, bushes, paths accepted deep or not at all, and paths that are not the tree's first
    nodes. The graders use it rather than a real drafter, which may be a later assignment."""

    def __init__(self, answer: list[int], vocab: int, seed: int = 0, nodes: int = 6, right: float = 0.6):
        self.answer, self.vocab, self.nodes, self.right = answer, vocab, nodes, right
        self.random = random.Random(seed)
        self.max_extra_inputs = nodes - 1

    def begin(self, request):
        super().begin(request)
        self.request, self.prompt_length = request, len(request.prompt_ids)

    def propose(self):
        done = len(self.history) - self.prompt_length  # new tokens so far: the root is answer[done - 1]
        tokens, parents, depths = [self.history[-1]], [-1], [0]
        for _ in range(self.random.randrange(self.nodes)):
            parent = self.random.randrange(len(tokens))
            depth = depths[parent] + 1
            truth = self.answer[done + depth - 1] if done + depth - 1 < len(self.answer) else 0
            tokens.append(truth if self.random.random() < self.right else self.random.randrange(self.vocab))
            parents.append(parent)
            depths.append(depth)
        return Tree(tokens, parents)


def assert_equals_vanilla_greedy(model, prompt, max_new_tokens, eos_ids, drafter):
    """The drafter's greedy output is vanilla's, token for token, stopping for the same reason."""
    vanilla = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    guessed = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=eos_ids, drafter=drafter)
    assert guessed.token_ids == vanilla.token_ids
    assert guessed.stop_reason == vanilla.stop_reason


VANILLA_ANSWERS = weakref.WeakKeyDictionary()  # model -> {(prompt ids, max_new_tokens, eos ids): its generation}


def vanilla_answer(model, ids: list[int], max_new_tokens: int, eos_ids):
    """The model's vanilla greedy generation for `ids`, generated once per process (the tests on the
    default model check several methods against the same answers, a few seconds each)."""
    answers = VANILLA_ANSWERS.setdefault(model, {})
    key = (tuple(ids), max_new_tokens, frozenset(eos_ids))
    if key not in answers:
        with torch.inference_mode():
            answers[key] = generate(model, ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    return answers[key]


def assert_shipped_guesser_equals_vanilla(model, tokenizer, drafter):
    """On the default model, a shipped guesser's greedy output is vanilla's, and some guesses pass."""
    for prompt in ["Give me three tips for staying focused while studying.",
                   "Explain what a hash table is."]:
        ids = tokenizer.prompt_ids(prompt, raw=False)
        with torch.inference_mode():
            guessed = generate(model, ids, max_new_tokens=48, eos_ids=tokenizer.eos_ids, drafter=drafter)
        assert guessed.token_ids == vanilla_answer(model, ids, 48, tokenizer.eos_ids).token_ids
        assert guessed.counts.guesses_accepted > 0


def self_distilled_record(model, seed, vocab):
    """A record as self_distill.py writes them: a random prompt and the model's greedy answer."""
    prompt = [random.Random(seed).randrange(vocab) for _ in range(4)]
    answer = generate(model, prompt, max_new_tokens=40, eos_ids=set()).token_ids
    return {"prompt_ids": prompt, "answer_ids": answer}


# ---- naive references ----------------------------------------------------------------------------

def ancestors_or_self(tree, node):
    found = {node}
    while tree.parents[node] != -1:
        node = tree.parents[node]
        found.add(node)
    return found


def all_paths(accuracy, max_depth):
    return [p for d in range(1, max_depth + 1) for p in itertools.product(range(len(accuracy[0])), repeat=d)]


def ngram_evidence(seen, context, n) -> tuple[list, list]:
    """The longest end of `context` (at most n-1 tokens) that occurs in `seen`, and every token that
    followed it there, in order; ([], []) when no end of it occurs."""
    for length in range(min(n - 1, len(context)), 0, -1):
        suffix = context[-length:]
        following = [seen[i] for i in range(length, len(seen)) if seen[i - length:i] == suffix]
        if following:
            return suffix, following
    return [], []


def naive_ngram_query(seen, context, n):
    """Scan everything seen: after the longest matching context (up to n-1 tokens), the most
    frequent next token, the one seen last among equally frequent ones."""
    _, following = ngram_evidence(seen, context, n)
    if not following:
        return None
    counts = {t: following.count(t) for t in following}
    return [t for t in following if counts[t] == max(counts.values())][-1]


@st.composite
def text_and_queries(draw):
    """Text over a small alphabet (so contexts repeat at every level) and queries: random token
    lists, and contexts cut from the text itself, which match at several levels at once."""
    seen = draw(st.lists(st.integers(0, 3), max_size=60))
    cuts = st.tuples(st.integers(0, len(seen)), st.integers(1, 6)).map(lambda c: seen[max(c[0] - c[1], 0):c[0]])
    return seen, draw(st.lists(st.lists(st.integers(0, 5), max_size=60) | cuts, max_size=6))


# ---- small exact models and a verifier's outcomes, enumerated --------------------------------------
#
# A "model" here is a table: for every prefix of guessed tokens, the distribution p of the next token
# over TABLE_VOCAB tokens. A verify step emits some tokens; continuing from them by sampling the model
# itself up to a fixed length must give exactly the model's own joint distribution of that length.

def random_table_model(rng: random.Random, max_depth: int, zeros: bool = True) -> dict:
    """prefix (tuple of tokens) -> p [TABLE_VOCAB] for every prefix up to max_depth tokens; some tokens get
    probability 0, as top-k / top-p cuts give them."""
    model = {}
    for length in range(max_depth + 1):
        for prefix in itertools.product(range(TABLE_VOCAB), repeat=length):
            weights = torch.tensor([rng.random() ** 2 for _ in range(TABLE_VOCAB)], dtype=torch.float64)
            if zeros and rng.random() < 0.4:
                weights[rng.randrange(TABLE_VOCAB)] = 0.0
            model[prefix] = weights / weights.sum()
    return model


def node_prefix(tree: Tree, node: int) -> tuple:
    return tuple(tree.tokens[n] for n in path_to(tree, node)[1:])


def tree_probs(tree: Tree, model: dict) -> torch.Tensor:
    """[N, TABLE_VOCAB]: what the forward pass would give, p after each node's path."""
    return torch.stack([model[node_prefix(tree, n)] for n in range(len(tree))])


class ScriptedChance(Chance):
    """Plays a script of outcome indices; past its end it takes outcome 0. Records every choice
    point (the outcome taken, how many there were) and the probability of the choices made."""

    def __init__(self, script):
        self.script, self.taken, self.weight = script, [], 1.0

    def accept(self, probability) -> bool:
        if not float(probability) >= 0:  # nan fails every comparison
            raise AssertionError(f"the verifier accepts a guess with probability {float(probability)}: a probability "
                                 "is a number >= 0 (a ratio p(x) / q(x) with q(x) = 0, or a nan from p or q?)")
        a = min(1.0, float(probability))
        return self.choose([(True, a), (False, 1.0 - a)])

    def draw(self, probs) -> int:
        weights = probs.tolist()
        if not all(w >= 0 for w in weights) or abs(sum(weights) - 1) > 1e-9:  # (nan fails w >= 0)
            raise AssertionError(f"the verifier draws a token from {[round(w, 6) for w in weights]}, which is not a "
                                 "distribution (nan, a negative entry, or a sum that is not 1: a residual "
                                 "norm(max(0, p - q)) with nothing left, p == q, divides 0 by 0)")
        return self.choose(list(enumerate(weights)))

    def choose(self, outcomes):
        outcomes = [(value, w) for value, w in outcomes if w > 0]
        depth = len(self.taken)
        pick = self.script[depth] if depth < len(self.script) else 0
        self.taken.append((pick, len(outcomes)))
        value, w = outcomes[pick]
        self.weight *= w
        return value


def outcomes(run_verifier) -> dict:
    """{emitted tokens: probability} over every sequence of random choices, depth first."""
    dist, scripts = Counter(), [[]]
    while scripts:
        script = scripts.pop()
        chance = ScriptedChance(script)
        dist[tuple(run_verifier(chance).tokens)] += chance.weight
        for depth in range(len(script), len(chance.taken)):  # choice points this run opened
            prefix = [pick for pick, _ in chance.taken[:depth]]
            scripts += [prefix + [alternative] for alternative in range(1, chance.taken[depth][1])]
    return dist


def continued(emitted: dict, model: dict, length: int) -> Counter:
    """Sequences of `length` tokens: each emission, continued by sampling the model itself."""
    joint = Counter()
    for tokens, w in emitted.items():
        for rest in itertools.product(range(TABLE_VOCAB), repeat=length - len(tokens)):
            seq, prob = tokens, w
            for token in rest:
                prob *= float(model[seq][token])
                seq += (token,)
            joint[seq] += prob
    return joint


def model_joint(model: dict, length: int) -> Counter:
    return continued({(): 1.0}, model, length)


def assert_same_distribution(got: dict, expected: dict):
    """Equal to 1e-12 for every outcome; else the outcomes that differ most, expected vs got."""
    worst = sorted(set(got) | set(expected), key=lambda seq: -abs(got.get(seq, 0.0) - expected.get(seq, 0.0)))
    if worst and abs(got.get(worst[0], 0.0) - expected.get(worst[0], 0.0)) > 1e-12:
        raise AssertionError("; ".join(f"P{seq} expected {expected.get(seq, 0.0):.6f}, got {got.get(seq, 0.0):.6f}"
                                       for seq in worst[:4]))


@st.composite
def deterministic_trees(draw, max_nodes=8, max_depth=3):
    """Random shapes and tokens, sibling tokens may repeat (parallel branches do that)."""
    tokens, parents, depths = [0], [-1], [0]
    for _ in range(draw(st.integers(0, max_nodes - 1))):
        parent = draw(st.sampled_from([n for n in range(len(tokens)) if depths[n] < max_depth]))
        tokens.append(draw(st.integers(0, TABLE_VOCAB - 1)))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return Tree(tokens, parents)


def draft_chain_outcomes(target: dict, draft: dict, gamma: int, verifier=verify_speculative) -> Counter:
    """A draft model samples gamma tokens from q, then the target verifies (`verifier`, as
    verify.verify_speculative): every draw enumerated."""
    emitted = Counter()
    for guess in itertools.product(range(TABLE_VOCAB), repeat=gamma):
        prefixes = [guess[:i] for i in range(gamma)]
        q_of_guess = 1.0
        for prefix, token in zip(prefixes, guess):
            q_of_guess *= float(draft[prefix][token])
        if q_of_guess == 0:
            continue
        tree = Tree.chain(7, list(guess), torch.stack([draft[prefix] for prefix in prefixes]))
        for tokens, w in outcomes(lambda chance: verifier(tree, tree_probs(tree, target), chance)).items():
            emitted[tokens] += q_of_guess * w
    return emitted
