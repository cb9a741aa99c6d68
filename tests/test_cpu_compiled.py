"""--compile (cpu_compiled.py): decoding passes compiled by torch.compile give the plain model's hidden
states and K/V (float32: to rounding, the sums run in another order), and so its greedy tokens, for
vanilla decoding and for trees of guesses (each of the float32 kernels cpu_kernels.py may pick,
called from compiled code), across windows of the cache, with two models in one process.
Each compilation of the tiny model takes some seconds."""

import pytest
import torch

from backends import cuda_graphs
from backends.cpu_compiled import CompiledModel
from backends.cpu_kernels import Linear
from decode import generate
from helpers import RandomGuesses, random_model, tiny_hf_config
from kv_cache import KVCache

VOCAB = 128


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    """Windows of 8, 16, 32 ... slots, so that short answers cross several of them."""
    monkeypatch.setattr(cuda_graphs, "MIN_WINDOW", 8)


def float32_model(seed: int = 0):
    """Every matrix a multiple of 64 rows, and each float32 kernel picked by some layers (as
    prepare_kernels may pick them on some CPU), so that compiled passes call all four: at 1 row the
    layers take turns with the bmm, numba's and F.linear, and from 3 rows take oneDNN's (the default)."""
    model = random_model(tiny_hf_config(heads=4, head_dim=16, vocab=VOCAB, max_position_embeddings=256), seed=seed,
                         dtype=torch.float32)
    linears = [layer for layer in model.modules() if isinstance(layer, Linear)]
    for index, layer in enumerate(linears):
        layer.picks = {1: ["blocked", "numba", "F.linear"][index % 3], 2: "F.linear"}
    return model


def random_prompt(seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (26,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("tree_rows", [1, 5])
def test_a_compiled_pass_gives_the_plain_hidden_states_and_cache(tree_rows):
    plain = float32_model()
    compiled = CompiledModel(plain)
    prefix = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, VOCAB, (1, tree_rows), generator=torch.Generator().manual_seed(2))
    hidden, caches = {}, {}
    for name, m in [("plain", plain), ("compiled", compiled)]:
        cache = caches[name] = KVCache.for_model(m, capacity=40)
        m(prefix, positions=torch.arange(20), cache=cache, slots=cache.claim(20))  # the prefill: plain
        for _ in range(3):  # then passes of tree_rows inputs, the later ones over what the earlier wrote
            start = cache.length
            hidden[name] = m.hidden_states(tokens, positions=torch.arange(start, start + tree_rows), cache=cache,
                                           slots=cache.claim(tree_rows))
    assert compiled.compiled_buckets == {next(b for b in cuda_graphs.STEP_BUCKETS if b >= tree_rows)}
    # float32 rounding apart: which GEMM sums a compiled product is timed at compile (max_autotune_gemm), so the
    # order of its sums, and the last bits, can change from run to run (1.1e-5 seen under a parallel test run)
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden["compiled"], hidden["plain"], **close)
    length = caches["plain"].length
    for part in ("keys", "values"):
        torch.testing.assert_close(getattr(caches["compiled"], part)[:, :, :, :length],
                                   getattr(caches["plain"], part)[:, :, :, :length], **close)


def test_vanilla_and_trees_of_guesses_give_the_plain_models_tokens_across_windows():
    plain = float32_model()
    compiled = CompiledModel(plain)
    timed = []  # per decoding pass, whether the backend compiled its program in it (then it is no L(n))
    for seed in (0, 1):
        prompt = random_prompt(seed)
        expected = generate(plain, prompt, max_new_tokens=100, eos_ids=set()).token_ids
        assert generate(compiled, prompt, max_new_tokens=100, eos_ids=set(),
                        on_pass=lambda done: timed.append(compiled.prepared_last_pass)).token_ids == expected
        guessed = generate(compiled, prompt, max_new_tokens=100, eos_ids=set(),
                           drafter=RandomGuesses(expected, VOCAB, seed=seed, nodes=12),
                           on_pass=lambda done: timed.append(compiled.prepared_last_pass))
        assert guessed.token_ids == expected
        assert guessed.counts.guesses_accepted > 20  # paths accepted deep and not, their K/V kept
    assert len({window for _, window in compiled.passes}) >= 3  # windows of 8 to 256 slots, one compilation
    assert compiled.compiled_buckets >= {1, 2, 4, 8, 16}  # more than 2 rows: the packed kernel
    # a pass that compiled timed its compilation, not L(n): the backend says so (L(n) then takes nothing
    # from it, calibrate.machine_latency), and only of it (the 1-input program: the first prefill's)
    assert timed.count(True) == len(compiled.compiled_buckets) - 1


def test_two_compiled_models_in_one_process_each_give_their_own_tokens():
    """The weights are constants of a compiled program: a second model must get a program of its own."""
    prompt = random_prompt(2)
    for seed in (3, 4):
        plain = float32_model(seed)
        expected = generate(plain, prompt, max_new_tokens=20, eos_ids=set()).token_ids
        assert generate(CompiledModel(plain), prompt, max_new_tokens=20, eos_ids=set()).token_ids == expected
