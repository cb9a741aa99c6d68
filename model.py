"""A Llama forward pass from scratch, in plain PyTorch.

The architecture (Touvron et al., "LLaMA", 2023, section 2.2; "Llama 2", 2023, GQA):
pre-normalisation with RMSNorm, rotary position embeddings (RoPE, Su et al. 2021) applied to queries
and keys, grouped-query attention (several query heads share one K/V head), and a SwiGLU MLP.
Read it top-down: `Llama`, `Block`, `Attention` and `grouped_attention`, `MLP`, then the formulas
(`rms_norm`, `rotary_cos_sin`, `apply_rotary`). Loading a checkpoint is checkpoint.py's.

What speculative decoding needs from it, beyond a plain causal LM:
- explicit `positions` and an explicit boolean `mask` over [cached tokens + new tokens], so a whole
  tree of candidate tokens is scored in one pass, each node attending to the cache and to its own
  ancestors only (see tree.py); with no mask the new tokens are causal, as in ordinary decoding;
- `embeds` instead of token ids, for inputs that are not tokens (PPD's trained soft tokens);
- the final hidden states next to the logits (Medusa heads read them).

Shapes: B batch, T new tokens, S = cached + T attended tokens, D hidden, H query heads,
K key/value heads, G = H / K query heads per K/V head, E head_dim, V vocabulary.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # checked by checkpoint.py: {"rope_type": "linear" or "llama3", ...}
    max_positions: int = 2048
    tie_embeddings: bool = False


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.fingerprint: dict | None = None  # the checkpoint's, set by checkpoint.py (artifacts.py checks it)
        self.folder = None  # where checkpoint.load_checkpoint found it

    @property
    def dtype(self):
        return self.embed.weight.dtype

    @property
    def device(self):
        return self.embed.weight.device

    def forward(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """(logits [B, T, V], hidden states [B, T, D]) for every new input."""
        hidden = self.hidden_states(tokens, embeds=embeds, positions=positions, cache=cache, slots=slots,
                                    mask=mask)
        return self.logits(hidden), hidden

    def hidden_states(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """Run the transformer over T new inputs; returns the final (normed) hidden states [B, T, D].

        tokens: [B, T] ids, or embeds: [B, T, D]; positions: [B, T] (or [T]) RoPE positions;
        cache: a KVCache (None: no history), and slots: where in it these T inputs' K/V go (claimed
        by the caller: `cache.claim(T)`, or APAR's pool); attention reads the cache's `length` slots;
        mask: [T, S] or [B, T, S] booleans over the S attended slots (None: every cached slot before
        `slots`, then causal over the new inputs).
        """
        x = self.embed(tokens) if embeds is None else embeds.to(self.dtype)
        T = x.shape[1]
        if cache is not None and slots is None:
            raise ValueError("a pass that writes the cache needs the slots it writes (cache.claim(T))")
        if mask is None and T > 1:  # (one new input attends to every slot: no mask at all)
            mask = causal_mask(0 if cache is None else slots.start, T, x.device)
        cos, sin = rotary_cos_sin(self.inv_freq, positions.view(-1, T), x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, index, cache, slots, mask)
        return self.norm(x)

    def logits(self, hidden):
        """[B, T, D] -> [B, T, V]. Kept separate so callers project only the positions they need."""
        return self.lm_head(hidden)


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): pre-normalisation."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, layer, cache, slots, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, layer, cache, slots, mask)
        return x + self.mlp(self.mlp_norm(x))


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        # q, k and v projections fused into one matrix: one matmul instead of three per layer
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, qkv_rows, bias=False)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.sdpa = False  # True: torch's fused attention (`sdpa_attention`), which a backend may turn on

    def forward(self, x, cos, sin, layer, cache, slots, mask):
        B, T, _ = x.shape  # x: [B, T, D]
        H, K, E = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * E, K * E, K * E], dim=-1)  # [B, T, H*E], [B, T, K*E], [B, T, K*E]
        q = apply_rotary(q.view(B, T, H, E).transpose(1, 2), cos, sin)  # [B, H, T, E]
        k = apply_rotary(k.view(B, T, K, E).transpose(1, 2), cos, sin)  # [B, K, T, E]
        v = v.view(B, T, K, E).transpose(1, 2)  # [B, K, T, E]
        if cache is not None:
            k, v = cache.write(layer, slots, k, v)  # [B, K, S, E]: everything cached plus these T tokens
        attend = sdpa_attention if self.sdpa else grouped_attention
        out = attend(q, k, v, mask)  # [B, H, T, E]
        return self.wo(out.transpose(1, 2).reshape(B, T, H * E))  # [B, T, D]


def grouped_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(E) + mask) v, with G = H/K consecutive query heads per K/V head (Ainslie
    et al. 2023), where the mask adds -inf wherever attention is not allowed.

    q: [B, H, T, E]; k, v: [B, K, S, E]; mask: [T, S] (shared by the batch) or [B, T, S] (each sequence
    its own, APAR's threads), True where attention is allowed, or None: allowed everywhere (a plain
    decoding step's one token, which sees the whole cache).
    """
    B, H, T, E = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    # the G query heads of a K/V head side by side as G*T rows, so each K/V head is read once, not copied
    q = q.reshape(B, K, G * T, E)  # [B, K, G*T, E]
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)  # [B, K, G*T, S]
    if mask is not None:
        allowed = mask.view(-1, 1, 1, T, S)  # [B or 1, 1, 1, T, S]: the same for every head of a group
        scores = scores.view(B, K, G, T, S).masked_fill(~allowed, -math.inf).view(B, K, G * T, S)
    weights = torch.softmax(scores.to(at_least_float32(scores.dtype)), dim=-1).to(v.dtype)
    return (weights @ v).view(B, H, T, E)  # [B, K, G*T, E] -> [B, H, T, E]


def sdpa_attention(q, k, v, mask):
    """grouped_attention by torch's fused kernel (one call; K/V shared by their groups without a copy).
    The same formula, summed in another order: tests/test_model.py checks that they agree."""
    T, S = q.shape[2], k.shape[2]
    attn_mask = None if mask is None else mask.view(-1, 1, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)  # [B, H, T, E]


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)), gate and up fused into one matrix."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (Zhang and Sennrich 2019).
    x: [..., D], weight: [D]."""
    wide = x.to(at_least_float32(x.dtype))  # bfloat16's 8 bits of mantissa would lose the small variance
    normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def at_least_float32(dtype):
    """float32 for 16-bit dtypes, else the dtype itself (float64 models stay float64 throughout)."""
    return torch.promote_types(dtype, torch.float32)


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """theta_i = base^(-2i/E) for i < E/2, optionally rescaled for long context. [E/2], float64."""
    dim = config.head_dim
    inv_freq = config.rope_theta ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        return inv_freq / scaling["factor"]
    return llama3_scaled(inv_freq, scaling)


def llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: long wavelengths slowed by `factor`, short ones kept, and a smooth
    interpolation between the two bands."""
    old_context = s["original_max_position_embeddings"]
    low_wavelen = old_context / s["low_freq_factor"]
    high_wavelen = old_context / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    interpolated = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    in_between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_between, interpolated, scaled)


def rotary_cos_sin(inv_freq, positions, dtype):
    """cos and sin of position * theta_i, laid out for rotate-half: [B, 1, T, E]."""
    wide = at_least_float32(dtype)
    angles = positions.to(wide)[..., None] * inv_freq.to(wide)  # [B, T, E/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, E]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """Rotate each pair (x_i, x_{i+E/2}) by its angle. x: [B, heads, T, E]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [B, heads, T, E]: (-x2, x1)
    return x * cos + rotated * sin


def causal_mask(cached: int, new: int, device) -> torch.Tensor:
    """[new, cached + new]: every new token sees the whole cache and the new tokens up to itself."""
    return torch.ones(new, cached + new, dtype=torch.bool, device=device).tril(diagonal=cached)
