"""Decoding passes replayed as CUDA graphs: the GPU path without launch overhead (`--backend cuda-graphs`).

On a GPU this model's pass is launch-bound: about 35 small kernels per layer, 30 layers, each launch
a few microseconds of Python and driver work while the GPU itself finishes each kernel sooner, so a
pass over 1 or 64 inputs costs about the same 13-20 ms on an H100 (64-71 tokens/s, twice what this
project's 2-core CPU does). A CUDA graph records a pass's kernels once and replays them all with one
launch: 2.5 ms a pass there, 345-391 tokens/s (docs/results.md). gpt-fast gets
there with `torch.compile(mode="reduce-overhead")`, which records graphs of compiled kernels; here
`torch.cuda.CUDAGraph` records the plain model, so a reader sees every step and the outputs are
the same kernels' outputs.

A graph replays fixed shapes at fixed addresses, so each pass is made static:
- its inputs are padded to the next of `STEP_BUCKETS` (1, 2, 4, ... 64 inputs): a padding row holds
  whatever input an earlier pass left there, attends to its own slot only, and writes its K/V to a
  slot just after the real inputs', one the cache does not hold (a later pass writes over it);
- attention reads a fixed window of the cache (the next power of two of slots, at least
  `MIN_WINDOW`) through a mask over the whole window, instead of the slots in use: the slots not in
  use are masked out, so the softmax gives them weight exactly 0;
- every pass reads and writes one K/V buffer, the one the graphs were recorded with: the graphed
  model adopts the decoding loop's KVCache at its first pass (what it holds is copied in, and its
  keys and values become views of the buffer), so the loop claims, truncates and packs slots as it
  always does, without knowing. The buffer is as large as the largest cache adopted so far, rounded
  up to a power of two (growing it drops the recorded passes).
One graph is recorded per (inputs bucket, window) the first time a pass needs it (a few tens of ms,
ten passes' worth: `prepared_last_pass` tells the loop that such a pass timed the recording, not L(n)).

Passes that do not fit run the plain model: more inputs than the largest bucket (a prompt's
prefill; on the adopted buffer, so the graphs see its K/V), a batch, or a cache that is not a
KVCache (APAR's pooled slots). Greedy outputs equal the plain model's: the same kernels, but softmax
and the attention product sum over a longer row of masked zeros, which can change float32's
rounding in the last bits (tests/test_cuda_graphs.py; tests/test_cuda.py on the default model).
On a CPU the same static passes run unrecorded: the tests check their padding and windows there.
"""

import weakref
from dataclasses import dataclass

import torch

from errors import UserError
from kv_cache import KVCache
from model import causal_mask

STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # inputs per graphed pass: a tree of guesses up to 64 nodes
MIN_WINDOW = 256  # slots attention reads at least; windows double from here


def check(device: torch.device, dtype: torch.dtype) -> None:
    """The CUDA-graphs backend's one check, made before any work: graphs are recorded on a GPU only."""
    if device.type != "cuda":
        raise UserError("--backend cuda-graphs records the decoding passes on a GPU: add --device cuda")


def apply(model, max_rows: int) -> "GraphedModel":
    """The backend: `model`'s decoding passes recorded and replayed, attention by torch's fused kernel."""
    use_sdpa(model)
    return GraphedModel(model)


def use_sdpa(model) -> None:
    """Attention by torch's fused kernel (model.sdpa_attention) in every layer: one kernel on a GPU
    where the written-out formula launches several."""
    for block in model.layers:
        block.attention.sdpa = True


class WindowCache:
    """The cache a recorded pass sees: K/V written at slot indices held in a tensor (so a replay
    reads the slots of the pass it replays) and the whole window returned, however much of it is in
    use (the mask says). keys, values: [layers, 1, K, window, E] views of the graphed model's buffer."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def write(self, layer: int, slots: torch.Tensor, k, v):
        self.keys[layer].index_copy_(2, slots, k)  # k, v: [1, K, T, E] into [1, K, window, E]
        self.values[layer].index_copy_(2, slots, v)
        return self.keys[layer], self.values[layer]


@dataclass
class StaticPass:
    """One recorded pass's inputs and output, at the addresses its graph reads and writes."""
    embeds: torch.Tensor  # [1, T, D]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]: where each input's K/V goes
    mask: torch.Tensor  # [T, window]
    cache: WindowCache
    hidden: torch.Tensor | None = None  # [1, T, D], the output
    graph: "torch.cuda.CUDAGraph | None" = None  # None on a CPU: the pass runs unrecorded

    def run(self, model) -> None:
        self.hidden = model.hidden_states(embeds=self.embeds, positions=self.positions, cache=self.cache,
                                          slots=self.slots, mask=self.mask)


class GraphedModel:
    """A Llama whose decoding passes replay CUDA graphs (see the module docstring); everything else
    (config, embed, logits, ...) is the wrapped model's."""

    LABEL = "graphed"  # in the key of this machine's saved L(n) (calibrate.machine_key)

    def __init__(self, model, capacity: int | None = None):
        """`capacity`: the most slots a cache it adopts may have (default: the model's context, plus
        room for a tree's extra inputs and the padding)."""
        self.model = model
        self.capacity = capacity or model.config.max_positions + 2 * STEP_BUCKETS[-1]
        self.buffer: KVCache | None = None  # [layers, 1, K, slots, E], grown to the largest cache adopted
        self.counting: torch.Tensor | None = None  # slot numbers 0, 1, ..., sliced per pass
        self.passes: dict[tuple[int, int], StaticPass] = {}  # (inputs, window) -> its recorded pass
        self.adopted = lambda: None  # a weak reference to the cache whose slots the buffer holds
        self.prepared_last_pass = False  # whether the latest pass recorded (compiled) its static pass first

    def __getattr__(self, name):  # called only for what GraphedModel does not define itself
        return getattr(self.model, name)

    def __call__(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """(logits [B, T, V], hidden states [B, T, D]), as Llama.forward."""
        hidden = self.hidden_states(tokens, embeds=embeds, positions=positions, cache=cache, slots=slots, mask=mask)
        return self.model.logits(hidden), hidden

    def hidden_states(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """model.hidden_states, through a recorded pass where the pass fits one."""
        self.prepared_last_pass = False
        if not self.adopt(cache):
            return self.model.hidden_states(tokens, embeds=embeds, positions=positions, cache=cache, slots=slots,
                                            mask=mask)
        if embeds is None:
            embeds = self.model.embed(tokens)
        T = embeds.shape[1]
        bucket = next((b for b in STEP_BUCKETS if b >= T), None)
        if bucket is None or not isinstance(slots, slice):  # (the buffer has room for any bucket's padding)
            return self.model.hidden_states(embeds=embeds, positions=positions, cache=cache, slots=slots, mask=mask)
        window = max(MIN_WINDOW, 1 << (slots.stop + bucket - T - 1).bit_length())
        key = (bucket, min(window, self.buffer.capacity))
        step = self.passes.get(key) or self.new_pass(*key)
        self.fill(step, embeds, positions.view(-1), slots, mask)
        self.run(step)
        return step.hidden[:, :T].clone()  # the next replay overwrites step.hidden

    def run(self, step: StaticPass) -> None:
        """Run `step`'s pass: replay its graph, recorded the first time (on a CPU: run it plainly)."""
        if step.graph is None and self.model.device.type == "cuda":
            step.graph = self.record(step)  # capturing lays the kernels down without running them
            self.prepared_last_pass = True
        if step.graph is None:
            step.run(self.model)
        else:
            step.graph.replay()

    def adopt(self, cache) -> bool:
        """Make `cache` keep its K/V in the buffer (once per cache: what it holds is copied in); False
        when it cannot (no cache, not a KVCache, a batch, too large)."""
        if cache is not None and cache is self.adopted():
            return True
        if not isinstance(cache, KVCache) or cache.keys.shape[1] != 1 or cache.capacity > self.capacity:
            return False
        if self.adopted() is not None:
            raise RuntimeError("a graphed model decodes into one cache at a time: the buffer holds another "
                               "live cache's K/V")
        if self.buffer is None or cache.capacity + STEP_BUCKETS[-1] > self.buffer.capacity:
            self.grow(cache.capacity + STEP_BUCKETS[-1])
        held = slice(0, cache.length)
        self.buffer.keys[:, :, :, held] = cache.keys[:, :, :, held]
        self.buffer.values[:, :, :, held] = cache.values[:, :, :, held]
        cache.keys = self.buffer.keys[:, :, :, :cache.capacity]
        cache.values = self.buffer.values[:, :, :, :cache.capacity]
        self.adopted = weakref.ref(cache)
        return True

    def grow(self, slots: int) -> None:
        """A buffer of at least `slots` (the next power of two, within capacity + the padding's room),
        so that memory follows the longest cache decoded, not the model's context; the passes recorded
        with the old buffer are dropped (a graph keeps the addresses it was recorded with)."""
        c, most = self.model.config, self.capacity + STEP_BUCKETS[-1]
        size = min(most, max(MIN_WINDOW, 1 << (slots - 1).bit_length()))
        self.buffer = self.counting = None  # (freed before the larger one is allocated)
        self.passes.clear()
        with torch.inference_mode(False):  # ordinary tensors: the loop packs the cache in place, in or out of inference mode
            self.buffer = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, size, dtype=self.model.dtype,
                                  device=self.model.device)
            self.counting = torch.arange(size, device=self.model.device)

    def new_pass(self, inputs: int, window: int) -> StaticPass:
        m, device = self.model, self.model.device
        with torch.inference_mode(False):
            step = StaticPass(embeds=torch.zeros(1, inputs, m.config.hidden_size, dtype=m.dtype, device=device),
                              positions=torch.zeros(inputs, dtype=torch.long, device=device),
                              slots=torch.zeros(inputs, dtype=torch.long, device=device),
                              mask=torch.zeros(inputs, window, dtype=torch.bool, device=device),
                              cache=WindowCache(self.buffer.keys[:, :, :, :window], self.buffer.values[:, :, :, :window]))
        self.passes[inputs, window] = step
        return step

    def fill(self, step: StaticPass, embeds, positions, slots: slice, mask) -> None:
        """Copy one pass's T inputs into `step`'s padded ones (a handful of device copies, no sync)."""
        bucket, window = step.mask.shape
        T = embeds.shape[1]
        start, stop = slots.start, slots.stop
        step.embeds[:, :T] = embeds
        step.positions[:T] = positions
        step.slots.copy_(self.counting[start:start + bucket])  # the inputs' slots, then the padding's
        if mask is None:
            mask = causal_mask(start, T, embeds.device)
        step.mask.zero_()
        step.mask[:T, :stop] = mask.reshape(T, stop)
        if T < bucket:
            padding = self.counting[:bucket - T]
            step.mask[T + padding, stop + padding] = True  # each padding row sees its own slot only

    def record(self, step: StaticPass) -> "torch.cuda.CUDAGraph":
        """Record `step`'s pass: run it once on a side stream first (kernels chosen, workspaces
        allocated, as torch.cuda.graph asks), then capture it. The warm-up computes the very pass about
        to be replayed, on the same inputs, so what it writes to the cache is what the replay writes."""
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            step.run(self.model)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.run(self.model)
        return graph
