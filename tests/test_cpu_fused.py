"""--fused (cpu_fused.py): a decoding pass as one numba loop gives model.py's hidden states, logits and K/V
to float32's rounding (with bfloat16 weights: model.py's float32 pass on the same rounded weights, and on
a CPU with AVX512-BF16 on each product's input rounded to bfloat16 too);
computes each input row bit for bit as it would be computed alone (a guess in a tree as the plain
decoding step that would reach it); so every method's tokens equal fused vanilla's exactly, on random
tiny models and on the default model; and passes it does not run (too many rows, a batch) are model.py's
own."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from backends import cpu_fused
from backends.cpu_fused import MAX_ROWS, FusedModel
from backends.cpu_kernels import Linear
from decode import generate
from drafters import NGramDrafter, TrieDrafter
from errors import UserError
from helpers import RandomGuesses, every_drafter, random_model, tiny_hf_config, trees, vanilla_answer
from kv_cache import KVCache
from tree import Tree

VOCAB = 64


WEIGHTS = [torch.float32, torch.bfloat16]  # the dtypes a fused model stores its weights in


def tiny_llama(seed: int = 0, dtype=torch.float32, **config):
    """A tiny Llama (float32, or its weights rounded to bfloat16) whose layers multiply as prepare_kernels
    has them on 2 AVX2 EPYC cores: numba's kernel for one row, oneDNN's for more (whose sums for a row
    change with the rows beside it)."""
    model = random_model(tiny_hf_config(vocab=VOCAB, **config), seed=seed, dtype=dtype)
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.picks = {1: "numba"}
    return model


def prefilled(model, prefix: list[int], room: int) -> KVCache:
    cache = KVCache.for_model(model, capacity=len(prefix) + room)
    model(torch.tensor([prefix]), positions=torch.arange(len(prefix)), cache=cache, slots=cache.claim(len(prefix)))
    return cache


def tree_pass(model, cache: KVCache, tree: Tree):
    """(hidden states [N, D], logits [N, V]) of one pass over `tree`'s nodes after what `cache` holds."""
    start = cache.length
    slots = cache.claim(len(tree))
    mask = None if len(tree) == 1 else tree.input_mask(start, "cpu")
    hidden = model.hidden_states(embeds=model.embed(torch.tensor([tree.tokens])),
                                 positions=tree.input_positions(start, "cpu"), cache=cache, slots=slots, mask=mask)
    return hidden[0], model.logits(hidden[0])


prefixes = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)


def model_pys_twin(fused: FusedModel, seed: int, weights, **config):
    """model.py's float32 model on `fused`'s weights (tiny_llama's), each matrix product's input rounded to
    bfloat16 first where `fused` rounds them (cpu_bfloat16's instruction), and how close their passes
    should be: float32's rounding, sums taken in other orders through two layers (logits of about 5 were
    found 2.4e-5 apart in 500 examples); with inputs rounded to bfloat16 only bfloat16's (an input a float32
    rounding apart can round to the next bfloat16, 2^-8 of it, and that moves everything after it)."""
    plain = tiny_llama(seed, weights, **config).float()
    if not fused.rounds_inputs:
        return plain, 1e-4
    for layer in plain.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(lambda layer, args: (args[0].bfloat16().float(),))
    return plain, 3e-2


@pytest.mark.parametrize("weights", WEIGHTS)
@given(prefix=prefixes, tree=trees(max_nodes=20), seed=st.integers(0, 3))
def test_a_fused_pass_gives_model_pys_hidden_states_logits_and_cache(weights, prefix, tree, seed):
    """With bfloat16 weights, the pass is model.py's float32 pass on the weights rounded to bfloat16 (and on
    a CPU with AVX512-BF16, each product's input too)."""
    fused = FusedModel(tiny_llama(seed, weights))
    plain, tolerance = model_pys_twin(fused, seed, weights)
    outputs, caches = {}, {}
    with torch.inference_mode():
        for name, m in [("plain", plain), ("fused", fused)]:
            caches[name] = prefilled(m, prefix, len(tree))
            outputs[name] = tree_pass(m, caches[name], tree)
    for ours, theirs in zip(outputs["fused"], outputs["plain"]):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    for part in ("keys", "values"):
        torch.testing.assert_close(getattr(caches["fused"], part), getattr(caches["plain"], part), rtol=tolerance,
                                   atol=tolerance)


@pytest.mark.parametrize("weights", WEIGHTS)
@given(prefix=prefixes, tree=trees(max_nodes=20), node=st.integers(0, 19), seed=st.integers(0, 3))
def test_a_guess_in_a_tree_is_computed_bit_for_bit_as_vanilla_decoding_computes_it(weights, prefix, tree, node,
                                                                                    seed):
    """The node's hidden state and logits in one pass over the whole tree equal, exactly, those of the plain
    decoding step that feeds it after its ancestors (one token a pass), and so do the K/V it leaves."""
    fused = FusedModel(tiny_llama(seed, weights))
    node %= len(tree)
    path = [node]
    while tree.parents[path[-1]] != -1:
        path.append(tree.parents[path[-1]])
    path.reverse()
    with torch.inference_mode():
        in_tree = prefilled(fused, prefix, len(tree))
        hidden, logits = tree_pass(fused, in_tree, tree)
        one_by_one = prefilled(fused, prefix, len(tree))
        for step in path:
            alone_hidden, alone_logits = tree_pass(fused, one_by_one, Tree([tree.tokens[step]], [-1]))
        in_tree.keep(len(prefix), path)
    assert torch.equal(hidden[node], alone_hidden[0])
    assert torch.equal(logits[node], alone_logits[0])
    for part in ("keys", "values"):
        assert torch.equal(getattr(in_tree, part)[:, :, :, :in_tree.length],
                           getattr(one_by_one, part)[:, :, :, :one_by_one.length])


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("seed, prompt_length", [(0, 20), (1, 20), (1, MAX_ROWS + 30)])  # (a prefill longer
# than a fused pass: model.py's, the same prompt rows for every method)
def test_every_method_gives_fused_vanillas_tokens_exactly(seed, prompt_length, weights):
    fused = FusedModel(tiny_llama(seed, weights, max_position_embeddings=256))
    prompt = torch.randint(3, VOCAB, (prompt_length,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.inference_mode():
        vanilla = generate(fused, prompt, max_new_tokens=80, eos_ids=set())
        drafters = every_drafter(fused) | {"anpd-k8": NGramDrafter(n=2, k=8),
                                            "random guesses": RandomGuesses(vanilla.token_ids, VOCAB, seed=seed,
                                                                            nodes=12)}
        for name, drafter in drafters.items():
            gen = generate(fused, prompt, max_new_tokens=80, eos_ids=set(), drafter=drafter)
            assert gen.token_ids == vanilla.token_ids, name
            if name == "random guesses":
                assert gen.counts.guesses_accepted > 20, "the test should accept guesses at many depths"


def test_fused_greedy_tokens_are_model_pys():
    plain = tiny_llama(2, max_position_embeddings=256)
    prompt = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        assert (generate(FusedModel(plain), prompt, max_new_tokens=100, eos_ids=set()).token_ids
                == generate(plain, prompt, max_new_tokens=100, eos_ids=set()).token_ids)


def test_bfloat16_weights_are_read_from_half_the_bytes_and_the_model_handed_over_stays_bfloat16():
    """The fused model keeps its weight matrices as bfloat16 words (2 bytes a weight) and a float32 copy of
    the model for the passes it leaves to model.py; the bfloat16 model it was given is not changed (bench.py
    times it eagerly beside the fused one); its saved L(n) is kept apart from a float32 fused model's."""
    given_model = tiny_llama(0, torch.bfloat16)
    fused = FusedModel(given_model)
    assert given_model.dtype == torch.bfloat16 and fused.dtype == torch.float32
    assert all(m.dtype == np.uint32 for m in [*fused.matrix_arrays, fused.lm_head_array])
    stored = sum(m.nbytes for m in fused.matrix_arrays)
    assert stored == 2 * sum(p.numel() for block in given_model.layers for p in block.parameters() if p.dim() == 2)
    assert fused.LABEL != FusedModel(tiny_llama(0)).LABEL


def test_odd_widths_in_bfloat16_are_refused_in_one_line():
    with pytest.raises(UserError, match="odd"):
        FusedModel(random_model(tiny_hf_config(vocab=VOCAB, intermediate_size=33), dtype=torch.bfloat16))


def test_machine_code_on_disk_goes_stale_when_a_module_compiled_into_it_changes(tmp_path, monkeypatch):
    """layers_pass's machine code on disk holds cpu_kernels.dot_rows's: an edit to cpu_kernels.py alone must
    make numba compile it again (here a cached function stamped with another module, both written here)."""
    import importlib

    (tmp_path / "uses.py").write_text("import numba\n\n@numba.njit(cache=True)\ndef plus_one(x):\n    return x + 1\n")
    (tmp_path / "used.py").write_text("ONE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import used
    import uses

    def fresh_on_disk():
        importlib.reload(uses)  # as a new process: the stamp read anew
        cpu_fused.also_stamped_with(uses.plus_one, used)
        return bool(uses.plus_one._cache._cache_file._load_index())
    cpu_fused.also_stamped_with(uses.plus_one, used)
    assert uses.plus_one(1) == 2  # compiled and written to disk
    assert fresh_on_disk()
    (tmp_path / "used.py").write_text("ONE = 2\n")
    assert not fresh_on_disk()


def test_the_wrapped_models_own_attributes_show_through():
    """Whatever builds a drafter from the model (its layers for a self-draft, its embedding, its rotary
    frequencies) finds the model's own, not the fused model's arrays."""
    plain = tiny_llama(0)
    fused = FusedModel(plain)
    names = [*plain._modules, *plain._buffers, *plain._parameters, *vars(plain)]
    assert {name for name in names if not name.startswith("_") and getattr(fused, name) is not getattr(plain, name)} == set()


@pytest.mark.parametrize("weights", WEIGHTS)
def test_passes_it_does_not_fuse_are_model_pys_own(monkeypatch, weights):
    """(With bfloat16 weights, model.py's in float32 on those weights, into the same float32 cache.)"""
    fused = FusedModel(tiny_llama(3, weights))
    plain = tiny_llama(3, weights).float()
    monkeypatch.setattr(cpu_fused, "layers_pass", None)  # a call to it would fail
    tokens = torch.randint(0, VOCAB, (2, MAX_ROWS + 1), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for batch in (tokens[:1], tokens[:, :9]):  # more rows than it fuses (a long prompt's prefill); a batch
            caches = [KVCache.for_model(plain, capacity=batch.shape[1], batch=len(batch)) for _ in range(2)]
            ours, theirs = [m.hidden_states(batch, positions=torch.arange(batch.shape[1]), cache=cache,
                                            slots=cache.claim(batch.shape[1])) for m, cache in zip((fused, plain), caches)]
            assert torch.equal(ours, theirs)


def test_the_default_model_fused_decodes_as_vanilla_and_every_guesser_as_fused_vanilla(default_model,
                                                                                       default_tokenizer):
    fused = FusedModel(default_model)
    prompt = default_tokenizer.prompt_ids("List three things a cat likes, then three a dog likes.", raw=False)
    eos = default_tokenizer.eos_ids
    with torch.inference_mode():
        vanilla = generate(fused, prompt, max_new_tokens=32, eos_ids=eos)
        assert vanilla.token_ids == vanilla_answer(default_model, prompt, 32, eos).token_ids
        for drafter in (NGramDrafter(), TrieDrafter()):
            assert generate(fused, prompt, max_new_tokens=32, eos_ids=eos, drafter=drafter).token_ids == vanilla.token_ids


@given(seed=st.integers(0, 10**6), rows=st.integers(1, 8), cached=st.integers(0, 20))
def test_the_fused_eagle_head_computes_the_heads_step(seed, rows, cached):
    """cpu_fused.FusedDraftHead: EAGLE's head (fc, its decoder layer over its cache with a tree's mask, the
    draft logits) as the loops run it equals eagle.EagleHead's output, logits and cache, up to float32's
    rounding (sums taken in other orders)."""
    from methods.eagle import EagleHead
    model = tiny_llama(seed % 7)
    generator = torch.Generator().manual_seed(seed)
    head = EagleHead(model.config, torch.arange(0, VOCAB, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    head = head.use_lm_head(model.lm_head).requires_grad_(False)
    fused = FusedModel(model).draft_head(head)
    D = model.config.hidden_size
    features, embeddings = torch.randn(2, 1, rows, D, generator=generator)
    positions = torch.arange(cached, cached + rows)
    mask = torch.rand(rows, cached + rows, generator=generator) < 0.6
    mask[:, cached:] |= torch.eye(rows, dtype=torch.bool)  # (each row sees itself)
    caches, outputs = [], []
    for runner in (head, fused):
        cache = KVCache(1, model.config.num_kv_heads, model.config.head_dim, cached + rows)
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=torch.Generator().manual_seed(seed)))
        cache.values.copy_(torch.randn(cache.values.shape, generator=torch.Generator().manual_seed(seed + 1)))
        cache.claim(cached)
        guessed = runner(features, embeddings, positions, cache=cache, slots=cache.claim(rows), mask=mask)
        outputs.append((guessed, runner.logits(guessed[0])))
        caches.append(cache)
    (guessed, logits), (fused_guessed, fused_logits) = outputs
    torch.testing.assert_close(fused_guessed, guessed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].keys, caches[0].keys, rtol=1e-4, atol=1e-4)
