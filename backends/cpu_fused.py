"""Each decoding pass as one loop compiled by numba, on a CPU (`--backend fused`): the pass without PyTorch's
dispatch, and every input row computed alike, whatever else shares its pass.

A float32 decoding pass of the default model reads its 538 MB of weights once (the matrix products,
cpu_kernels.py) and spends the rest of its time in ~1,800 small tensor operations between them (norms,
rotary, attention, the cache's writes), each a few microseconds of Python and dispatch whatever its size.
Here the whole pass is one call: `layers_pass` runs model.py's computation (RMSNorm, RoPE, grouped-query
attention over the cache with the tree's mask, SwiGLU) as plain loops that numba compiles, the products
by cpu_kernels.dot_rows. On 2 AVX2 EPYC cores plain decoding so runs 1.48-1.66x faster than through
model.py, level with llama.cpp's F32 on the same weights within that machine's noise (1.01-1.13x of it in
one run, 0.81-0.95x in another; docs/results.md, "One compiled loop per pass" and the section after it):
the route llama.cpp takes (one C function per operation, no framework between them), written here in
Python's syntax.

**bfloat16 weights** (`--dtype bfloat16`). Plain decoding reads every weight once a pass, so it takes as
long as the memory takes to deliver them: stored as bfloat16, half the bytes, the products take about
half the time (cpu_kernels.bfloat16_words stores them two to a 32-bit word). On a CPU with AVX512-BF16
they are multiplied by its bfloat16 instruction, each product's input rounded to bfloat16 as that
instruction needs (cpu_bfloat16.py; 12.1 ms for a pass over 1 input on 2 Intel Xeon cores, against
float32's 22-24: the memory's limit); elsewhere `dot_rows` widens each weight to float32 with a shift and
does all its arithmetic in float32 (14-16 ms there). Either way every activation, sum and the cache stay
float32: the model is the float32 model with its weights rounded to bfloat16 (and, by the instruction,
each product's input), not the bfloat16 arithmetic of model.py's `--dtype bfloat16`, whose every
operation rounds to bfloat16.

**Batch invariance.** The same loop computes each input row the same way whatever the other rows of
its pass are: a row's dot products are summed by `dot_rows` in one order, which depends on the row's
length, never on how many rows come with it (rows go two at a time, sharing each weight's load, only
where this machine's compiled loops sum a row of a pair as a row alone, bit for bit: checked when the
model is fused, `pairs_sum_as_rows_alone`; one at a time otherwise), each norm and each SwiGLU is summed
row by row, and each query attends to a list of the slots it may see, gathered in slot order, so that a
token attends in a tree pass to exactly the values it attends to in a plain decoding step, in the same
order. So the hidden state and logits of an accepted guess are bit for bit those plain decoding
computes for that token (the K/V it left in the cache too), and every lossless method's greedy output
is fused vanilla's, near-ties included, not only up to float32's rounding as through
model.py, whose PyTorch kernels round a row differently with the number of rows beside it (He and
Thinking Machines Lab 2025, "Defeating Nondeterminism in LLM Inference", on batch-invariant kernels).
tests/test_cpu_fused.py proves it by hypothesis.

A pass of more than `MAX_ROWS` inputs (a long prompt's prefill) runs as model.py's pass, whose MKL GEMM
multiplies hundreds of rows about twice as fast as these loops (a 2,206-token prompt on 2 EPYC cores:
6.4-6.8 s against 14.0-18.6 as fused passes of `MAX_ROWS` rows; docs/results.md), into the same float32
cache. Its rows are then rounded by how many rows share the product, but decode.prefill sends the prompt
but its last token alone, whatever method runs (the last token and PPD's soft tokens follow in a pass of
their own), so every method's prompt K/V are the same and its greedy output fused vanilla's on long
prompts too. Nor can fused passes run a batch, gradients, or a cache that is not a KVCache (APAR's pooled
slots, training's frozen prefix): those go to model.py as well.
"""

import copy
import hashlib
import math
import sys

import numba
import numba.extending
import numpy as np
import torch

from backends import cpu_bfloat16
from backends import cpu_kernels
from backends.cpu_kernels import bfloat16_words, dot_rows, numba_threads_as_torch, pairs_sum_as_rows_alone, use_kernels
from errors import UserError
from kv_cache import KVCache

MAX_ROWS = 64  # inputs per fused pass at most: trees of guesses; a longer pass (a prompt's) is model.py's
# how a fused pass stores each weight matrix, by the model's dtype (cpu_kernels.dot_rows reads either)
WEIGHTS = {torch.float32: torch.Tensor.numpy, torch.bfloat16: bfloat16_words}


def check(device: torch.device, dtype: torch.dtype) -> None:
    """The fused backend's one check, made before any work."""
    if device.type != "cpu":
        raise UserError("--backend fused compiles the decoding passes for a CPU; on a GPU use --backend cuda-graphs")
    if dtype not in WEIGHTS:
        raise UserError("--backend fused reads float32 or bfloat16 weights; add --dtype float32 or --dtype bfloat16")


def apply(model, max_rows: int) -> "FusedModel":
    """The backend: `model`'s decoding passes fused; the passes it leaves to model.py (a long prompt's
    prefill) and the Medusa heads cut from its LM head take cpu_kernels.py's few-row kernels."""
    use_kernels(model, max_rows)
    return FusedModel(model)


def products(weight, x, out, pairs):
    """out = x W^T, for a pass: with bfloat16 words on a CPU with AVX512-BF16 by that instruction, each
    input rounded to bfloat16 (cpu_bfloat16.py: 1.2-1.4x faster at 1-8 inputs on 2 Intel Xeon cores);
    otherwise by cpu_kernels.dot_rows, in float32 (compiled: the overload below picks one by the weights'
    type, once)."""
    if weight.dtype == np.uint32 and cpu_bfloat16.NATIVE:
        cpu_bfloat16.dot_rows(weight, x, out)
    else:
        dot_rows(weight, x, out, pairs)


@numba.extending.overload(products)
def _products(weight, x, out, pairs):
    if weight.dtype == numba.uint32 and cpu_bfloat16.NATIVE:
        return lambda weight, x, out, pairs: cpu_bfloat16.dot_rows(weight, x, out)
    return lambda weight, x, out, pairs: dot_rows(weight, x, out, pairs)


@numba.njit(fastmath=True, cache=True)
def norm_rows(x, weight, eps, out):
    """RMSNorm, row by row: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. x, out: [R, D]."""
    for r in range(x.shape[0]):
        total = numba.float32(0.0)
        for i in range(x.shape[1]):
            total += x[r, i] * x[r, i]
        scale = numba.float32(1.0) / np.sqrt(total / numba.float32(x.shape[1]) + numba.float32(eps))
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * scale * weight[i]


@numba.njit(fastmath=True, cache=True)
def rotate(heads, position, inv_freq):
    """RoPE in place, rotate-half layout as model.apply_rotary: each pair (x_i, x_{i+E/2}) of each head
    turned by position * theta_i. heads: [heads, E]; inv_freq: [E/2] float32."""
    half = heads.shape[1] // 2
    for i in range(half):
        angle = numba.float32(position) * inv_freq[i]
        cos, sin = np.cos(angle), np.sin(angle)
        for head in range(heads.shape[0]):
            a, b = heads[head, i], heads[head, half + i]
            heads[head, i] = a * cos - b * sin
            heads[head, half + i] = b * cos + a * sin


@numba.njit(fastmath=True, cache=True)
def attend(query, keys, values, seen, count, out):
    """softmax(q k^T / sqrt(E)) v over the `count` slots `seen[:count]` (ascending). query, out: [E];
    keys, values: [slots, E] of one K/V head."""
    scale = numba.float32(1.0 / math.sqrt(query.shape[0]))
    scores = np.empty(count, dtype=np.float32)
    top = numba.float32(-np.inf)
    for j in range(count):
        key = keys[seen[j]]
        total = numba.float32(0.0)
        for e in range(query.shape[0]):
            total += query[e] * key[e]
        scores[j] = total * scale
        top = max(top, scores[j])
    mass = numba.float32(0.0)
    for j in range(count):
        scores[j] = np.exp(scores[j] - top)
        mass += scores[j]
    out[:] = 0.0
    for j in range(count):
        weight, value = scores[j] / mass, values[seen[j]]
        for e in range(out.shape[0]):
            out[e] += weight * value[e]


@numba.njit(parallel=True, fastmath=True, cache=True)
def attention(qkv, positions, inv_freq, keys, values, slots, mask, heads, kv_heads, out):
    """One layer's attention for T inputs: rotate each input's queries and keys, write its K/V to its slot,
    then each query head attends over the slots its row of `mask` allows. qkv: [T, (H + 2K) E] (rotated in
    place); keys, values: [K, slots, E] (the layer's cache); slots: [T]; mask: [T, S]; out: [T, H E]."""
    T, E = qkv.shape[0], keys.shape[2]
    for t in range(T):
        row = qkv[t].reshape(heads + 2 * kv_heads, E)
        rotate(row[:heads + kv_heads], positions[t], inv_freq)
        for kv in range(kv_heads):
            keys[kv, slots[t]] = row[heads + kv]
            values[kv, slots[t]] = row[heads + kv_heads + kv]
    group = heads // kv_heads  # query heads per K/V head (GQA)
    for job in numba.prange(T * heads):
        t, head = job // heads, job % heads
        seen = np.empty(mask.shape[1], dtype=np.int64)  # the slots row t may see, in slot order
        count = 0
        for s in range(mask.shape[1]):
            if mask[t, s]:
                seen[count] = s
                count += 1
        attend(qkv[t, head * E:(head + 1) * E], keys[head // group], values[head // group], seen, count,
               out[t, head * E:(head + 1) * E])


@numba.njit(fastmath=True, cache=True)
def swiglu(gate_up, out):
    """silu(gate) * up, row by row. gate_up: [R, 2F] (gate, then up); out: [R, F]."""
    width = out.shape[1]
    for r in range(gate_up.shape[0]):
        for i in range(width):
            gate = gate_up[r, i]
            out[r, i] = gate / (numba.float32(1.0) + np.exp(-gate)) * gate_up[r, width + i]


@numba.njit(parallel=True, fastmath=True, cache=True)
def layers_pass(x, norms, matrices, positions, inv_freq, keys, values, slots, mask, heads, kv_heads, eps, pairs,
                out):
    """Every layer over T inputs, then the final norm into `out`: model.Llama.hidden_states as loops.
    x: [T, D] (the inputs' embeddings, overwritten: the residual stream); norms: each layer's attention
    and MLP norm weights, then the final norm's; matrices: each layer's wqkv, wo, w_gate_up, w_down (typed
    lists, so that one compilation serves models of any depth); keys, values: [layers, 1, K, capacity, E],
    the cache; slots, positions: [T]; mask: [T, S] over the cache's first S slots; pairs: dot_rows' choice (products);
    out: [T, D]."""
    T, E = x.shape[0], keys.shape[4]
    normed, update = np.empty_like(x), np.empty_like(x)
    for layer in range(len(matrices) // 4):
        attention_norm, mlp_norm = norms[2 * layer], norms[2 * layer + 1]
        wqkv, wo = matrices[4 * layer], matrices[4 * layer + 1]
        w_gate_up, w_down = matrices[4 * layer + 2], matrices[4 * layer + 3]
        norm_rows(x, attention_norm, eps, normed)
        qkv = np.empty((T, wqkv.shape[0]), dtype=np.float32)
        products(wqkv, normed, qkv, pairs)
        attended = np.empty((T, heads * E), dtype=np.float32)
        attention(qkv, positions, inv_freq, keys[layer, 0], values[layer, 0], slots, mask, heads, kv_heads, attended)
        products(wo, attended, update, pairs)
        x += update
        norm_rows(x, mlp_norm, eps, normed)
        gate_up = np.empty((T, w_gate_up.shape[0]), dtype=np.float32)
        products(w_gate_up, normed, gate_up, pairs)
        activated = np.empty((T, w_gate_up.shape[0] // 2), dtype=np.float32)
        swiglu(gate_up, activated)
        products(w_down, activated, update, pairs)
        x += update
    norm_rows(x, norms[len(norms) - 1], eps, out)


def also_stamped_with(function, *modules) -> None:
    """Make numba's copy on disk of `function`'s machine code stale when a module's source changes, too.
    numba reuses it while the function's own file is unchanged, but layers_pass has cpu_kernels.dot_rows
    and cpu_bfloat16.dot_rows compiled into it: an edit to cpu_kernels.py alone ran the old products (seen
    while writing its bfloat16 loop). The stamp is numba's own (a private attribute numba 0.68 keeps;
    where a version lacks it, nothing changes)."""
    cache_file = getattr(getattr(function, "_cache", None), "_cache_file", None)
    if hasattr(cache_file, "_source_stamp"):
        sources = [hashlib.sha256(open(module.__file__, "rb").read()).hexdigest() for module in modules]
        cache_file._source_stamp = (cache_file._source_stamp, *sources)


also_stamped_with(layers_pass, cpu_kernels, cpu_bfloat16)


def compiled_on_disk() -> bool:
    """Whether numba's cache on disk (beside this file, or NUMBA_CACHE_DIR) holds layers_pass's machine code,
    fresh, as an earlier process compiled it (read through numba's private attributes: where a version
    lacks them, assume so)."""
    cache_file = getattr(getattr(layers_pass, "_cache", None), "_cache_file", None)
    return not hasattr(cache_file, "_load_index") or bool(cache_file._load_index())


class FusedModel:
    """A Llama whose decoding passes run as `layers_pass` (see the module docstring), and whose logits
    come from the same product loop; everything else (config, embed, ...) is the wrapped
    model's."""

    def __init__(self, model):
        layout = WEIGHTS[model.dtype]
        # in the key of this machine's saved L(n) (calibrate.machine_key), which names the dtype of the
        # arithmetic: float32 either way, but for the products' inputs, rounded to bfloat16 where
        # cpu_bfloat16's instruction multiplies
        self.rounds_inputs = model.dtype == torch.bfloat16 and cpu_bfloat16.NATIVE
        self.LABEL = ("fused" if model.dtype == torch.float32 else
                      "fused, bfloat16 weights and products" if self.rounds_inputs else "fused, bfloat16 weights")
        # the passes it leaves to model.py compute as the fused ones, in float32, into the same float32
        # cache: a bfloat16 model's weights are float32's exactly (a bfloat16 is a float32's top half)
        self.model = model if model.dtype == torch.float32 else copy.deepcopy(model).float()
        # the weights for layers_pass: numpy views of the float32 model's (no copy), or bfloat16 words;
        # named apart from the model's own attributes, which reach through __getattr__
        self.norm_arrays = numba.typed.List(
            [p.detach().numpy() for block in self.model.layers
             for p in (block.attention_norm.weight, block.mlp_norm.weight)] + [self.model.norm.weight.detach().numpy()])
        matrices = [p for block in model.layers for p in (block.attention.wqkv.weight, block.attention.wo.weight,
                                                          block.mlp.w_gate_up.weight, block.mlp.w_down.weight)]
        odd = sorted({m.shape[1] for m in matrices if m.shape[1] % 2})
        if model.dtype == torch.bfloat16 and odd:
            raise UserError(f"--backend fused stores bfloat16 weights two to a word, and this model has matrices {odd[0]} "
                            "columns wide (odd); add --dtype float32")
        self.matrix_arrays = numba.typed.List(map(layout, matrices))
        self.lm_head_array = layout(model.lm_head.weight)
        self.inv_freq_array = model.inv_freq.to(torch.float32).numpy()
        if not layers_pass.signatures and not compiled_on_disk():
            print("--backend fused: numba compiles the pass's loops, once (about 20 s on 2 cores; then kept on disk)",
                  file=sys.stderr, flush=True)
        # rows two at a time in the products only where that sums each row as it is summed alone
        self.pairs = pairs_sum_as_rows_alone([m.shape[1] for m in [*matrices, model.lm_head.weight]], layout)
        with torch.inference_mode():  # compiled (or read from disk) now, not in the first timed pass
            one_pass = KVCache.for_model(self.model, capacity=1)
            self.hidden_states(embeds=self.model.embed.weight[:1][None], positions=torch.zeros(1, dtype=torch.long),
                               cache=one_pass, slots=one_pass.claim(1))

    def __getattr__(self, name):  # called only for what FusedModel does not define itself
        return getattr(self.model, name)

    def __call__(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """(logits [B, T, V], hidden states [B, T, D]), as Llama.forward."""
        hidden = self.hidden_states(tokens, embeds=embeds, positions=positions, cache=cache, slots=slots, mask=mask)
        return self.logits(hidden), hidden

    def hidden_states(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """model.hidden_states, as one fused pass where it can run it (see the module docstring)."""
        if embeds is None:
            embeds = self.model.embed(tokens)
        if not fusable(embeds, cache):
            return self.model.hidden_states(embeds=embeds, positions=positions, cache=cache, slots=slots, mask=mask)
        T = embeds.shape[1]
        x, hidden = embeds[0].numpy().copy(), np.empty((T, embeds.shape[2]), dtype=np.float32)
        fused_layers(x, self.norm_arrays, self.matrix_arrays, self.inv_freq_array, self.config, positions, cache, slots,
                     mask, self.pairs, hidden)
        return torch.from_numpy(hidden).view(1, T, -1)

    def logits(self, hidden):
        """[..., D] -> [..., V] by the same product loop, whatever the number of rows."""
        return product_rows(self.lm_head_array, hidden, self.pairs)

    def draft_head(self, head) -> "FusedDraftHead":
        """EAGLE's draft head (methods/eagle.py) run by the same loops."""
        return FusedDraftHead(head, self.pairs)


def fusable(embeds: torch.Tensor, cache) -> bool:
    """Whether a pass over `embeds` ([B, T, D]) into `cache` can run fused (see the module docstring)."""
    B, T, _ = embeds.shape
    return T <= MAX_ROWS and B == 1 and type(cache) is KVCache and cache.keys.shape[1] == 1 and not embeds.requires_grad


def fused_layers(x, norms, matrices, inv_freq, config, positions, cache, slots, mask, pairs, out) -> None:
    """layers_pass over the rows of x ([T, D], numpy, overwritten: the residual stream), their positions,
    slots and mask given as to model.hidden_states; the final norm (norms' last) into out [T, D]."""
    T = x.shape[0]
    slot_numbers = np.arange(cache.length)[slots if isinstance(slots, slice) else slots.numpy()]  # [T]
    if mask is None:  # as model.hidden_states: the whole cache before the new inputs, causal among them
        seen = np.arange(cache.length)
        allowed = seen[None, :] <= slot_numbers[:, None]  # [T, S]
    else:
        allowed = mask.reshape(T, -1).numpy()
    numba_threads_as_torch()
    layers_pass(x, norms, matrices, positions.reshape(T).numpy(), inv_freq, cache.keys.numpy(), cache.values.numpy(),
                slot_numbers, allowed, config.num_heads, config.num_kv_heads, config.rms_norm_eps, pairs, out)


def product_rows(weight, rows: torch.Tensor, pairs) -> torch.Tensor:
    """[..., I] -> [..., O]: rows W^T by `products`, for W (numpy) [O, I]."""
    flat = np.ascontiguousarray(rows.reshape(-1, rows.shape[-1]).numpy())
    out = np.empty((len(flat), weight.shape[0]), dtype=np.float32)
    numba_threads_as_torch()
    products(weight, flat, out, pairs)
    return torch.from_numpy(out).view(*rows.shape[:-1], -1)


class FusedDraftHead:
    """EAGLE's draft head (methods/eagle.py `EagleHead`) with its decoder layer as a fused pass of one
    layer and its linear layer and draft logits by the same product loop. The layer's output is the
    residual stream layers_pass leaves in its input (the head has no final norm: the norm it is given,
    all ones, writes into a scratch array). Everything else (draft_ids, config, training) is the head's."""

    def __init__(self, head, pairs):
        self.head, self.pairs = head, pairs
        block = head.layer
        self.norm_arrays = numba.typed.List([block.attention_norm.weight.detach().float().numpy(),
                                             block.mlp_norm.weight.detach().float().numpy(),
                                             np.ones(head.config.hidden_size, dtype=np.float32)])
        self.matrix_arrays = numba.typed.List([m.weight.detach().float().numpy() for m in (
            block.attention.wqkv, block.attention.wo, block.mlp.w_gate_up, block.mlp.w_down)])
        self.fc_array, self.fc_bias = head.fc.weight.detach().float().numpy(), head.fc.bias.detach().float()
        self.draft_lm_head_array = np.ascontiguousarray(head.draft_lm_head.float().numpy())
        self.inv_freq_array = head.inv_freq.to(torch.float32).numpy()

    def __getattr__(self, name):  # called only for what FusedDraftHead does not define itself
        return getattr(self.head, name)

    def __call__(self, features, embeddings, positions, cache=None, slots=None, mask=None):
        """EagleHead.forward, fused where the pass can be (`fusable`)."""
        if features.dtype != torch.float32 or not fusable(features, cache):
            return self.head(features, embeddings, positions, cache, slots, mask)
        T = features.shape[1]
        x = product_rows(self.fc_array, torch.cat([embeddings, features], dim=-1)[0], self.pairs) + self.fc_bias
        x, scratch = x.numpy(), np.empty_like(x.numpy())
        fused_layers(x, self.norm_arrays, self.matrix_arrays, self.inv_freq_array, self.config, positions, cache, slots,
                     mask, self.pairs, scratch)
        return torch.from_numpy(x).view(1, T, -1)

    def logits(self, features):
        """[..., D] -> [..., W]: EagleHead.logits by the product loop."""
        if features.requires_grad:
            return self.head.logits(features)
        return product_rows(self.draft_lm_head_array, features, self.pairs)
