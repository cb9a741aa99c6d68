"""A Llama forward pass from scratch, and loading of Hugging Face safetensors checkpoints.

The architecture (Touvron et al., "LLaMA", 2023, section 2.2; "Llama 2", 2023, GQA):
pre-normalisation with RMSNorm, rotary position embeddings (RoPE, Su et al. 2021) applied to queries
and keys, grouped-query attention (several query heads share one K/V head), and a SwiGLU MLP.

What speculative decoding needs from it, beyond a plain causal LM:
- explicit `positions` and an explicit boolean `mask` over [cached tokens + new tokens], so a whole
  tree of candidate tokens is scored in one pass, each node attending to the cache and to its own
  ancestors only (see tree.py); with no mask the new tokens are causal, as in ordinary decoding;
- `embeds` instead of token ids, for inputs that are not tokens (PPD's trained soft tokens);
- the final hidden states next to the logits (Medusa heads read them).

Shapes: B batch, T new tokens, S = cached + T attended tokens, D hidden, H query heads,
K key/value heads, G = H / K query heads per K/V head, E head_dim, V vocabulary.

The linear layers are cpu_kernels.Linear: nn.Linear with faster CPU kernels for decoding's few rows
(the same y = x W^T; read it as nn.Linear).
"""

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from cpu_kernels import Linear  # nn.Linear, with faster CPU kernels for decoding's few rows
from errors import UserError


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}  # --dtype


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {name!r} is not supported (use cpu, cuda or cuda:N)")
    return device


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
    rope_scaling: dict | None = None
    max_positions: int = 2048
    tie_embeddings: bool = False

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Read a Hugging Face Llama config.json (either the rope_theta/rope_scaling or the newer
        rope_parameters spelling), every value checked to be of its kind: a wrong one is one line
        naming it, not a crash deep in the forward pass."""
        if not isinstance(hf, dict):
            raise UserError("config.json is not a JSON object")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise UserError(f"config.json is missing {', '.join(missing)}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UserError("config.json asks for attention/MLP biases, which Llama does not have")
        rope = config_entry(hf, "rope_parameters", dict, {})
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        num_heads = config_entry(hf, "num_attention_heads", int)
        hidden_size = config_entry(hf, "hidden_size", int)
        config = cls(
            vocab_size=config_entry(hf, "vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=config_entry(hf, "intermediate_size", int),
            num_layers=config_entry(hf, "num_hidden_layers", int),
            num_heads=num_heads,
            num_kv_heads=config_entry(hf, "num_key_value_heads", int, num_heads),
            head_dim=config_entry(hf, "head_dim", int, hidden_size // num_heads),
            rms_norm_eps=config_entry(hf, "rms_norm_eps", float, 1e-5),
            rope_theta=config_entry(rope, "rope_theta", float, config_entry(hf, "rope_theta", float, 10000.0)),
            rope_scaling=scaling,
            max_positions=config_entry(hf, "max_position_embeddings", int, 2048),
            tie_embeddings=config_entry(hf, "tie_word_embeddings", bool, False),
        )
        if config.num_heads % config.num_kv_heads:
            raise UserError(f"num_attention_heads ({config.num_heads}) is not a multiple of "
                            f"num_key_value_heads ({config.num_kv_heads})")
        rope_inverse_frequencies(config)  # reject an unsupported rope_scaling now, not mid-generation
        return config


REQUIRED = object()


def config_entry(hf: dict, key: str, kind: type, default=REQUIRED, within: str = ""):
    """hf[key] (or `default` when it is absent or null), checked: a positive whole number (int), a
    positive finite number (float), true/false (bool), or an object (dict); `within` names the object
    that holds it in messages ("rope_scaling.")."""
    value = hf.get(key)
    if value is None and default is not REQUIRED:
        return default
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        wanted = "a positive whole number"
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf
        wanted = "a positive number"
    elif kind is bool:
        ok, wanted = isinstance(value, bool), "true or false"
    else:
        ok, wanted = isinstance(value, dict), "an object {...}"
    if not ok:
        raise UserError(f"config.json: {within}{key} must be {wanted}, got {json.dumps(value)}")
    return float(value) if kind is float else value


def at_least_float32(dtype):
    """float32 for 16-bit dtypes, else the dtype itself (float64 models stay float64 throughout)."""
    return torch.promote_types(dtype, torch.float32)


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
    # torch's fused call for the formula: one call from Python instead of six (a GPU runs it as one kernel,
    # a CPU its steps inside, without the dispatch between them; a decoding step runs 61 of these: on 2 CPU
    # cores 13 us against 22 each, and a CUDA-graphed pass on an H100 3.25 -> 2.78 ms); it sums in float32
    # for 16-bit x, which would otherwise lose the small variance, and rounds once
    return F.rms_norm(x, weight.shape, weight, eps)


ROPE_SCALING_KEYS = {"linear": ["factor"],
                     "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]}


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """theta_i = base^(-2i/E) for i < E/2, optionally rescaled for long context. [E/2], float64."""
    dim = config.head_dim
    inv_freq = config.rope_theta ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    if not isinstance(scaling, dict):
        raise UserError(f"config.json: rope_scaling must be an object or null, got {json.dumps(scaling)}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALING_KEYS:
        raise UserError(f"rope_scaling type {kind!r} is not supported (only 'linear' and 'llama3')")
    for key in ROPE_SCALING_KEYS[kind]:
        config_entry(scaling, key, float, within="rope_scaling.")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise UserError("config.json: rope_scaling's low_freq_factor must be below its high_freq_factor")
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
    return torch.addcmul(x * cos, rotated, sin)  # x cos + rotated sin, one operation fewer per layer


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        # q, k and v projections fused into one matrix: one matmul instead of three per layer
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.wqkv = Linear(config.hidden_size, qkv_rows, bias=False)
        self.wo = Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer, cache, slots, mask):
        B, T, _ = x.shape  # x: [B, T, D]
        H, K, E = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split([(H + K) * E, K * E], dim=-1)  # [B, T, (H+K)*E], [B, T, K*E]
        # queries and keys rotate alike, so one call rotates both: a decoding step runs ~60 small tensor
        # operations per layer, each a few microseconds of dispatch whatever its size, and a second
        # apply_rotary would be six more
        qk = apply_rotary(qk.view(B, T, H + K, E).transpose(1, 2), cos, sin)  # [B, H+K, T, E]
        q, k = qk.split([H, K], dim=1)  # [B, H, T, E], [B, K, T, E]
        v = v.view(B, T, K, E).transpose(1, 2)  # [B, K, T, E]
        if cache is not None:
            k, v = cache.write(layer, slots, k, v)  # [B, K, S, E]: everything cached plus these T tokens
        out = grouped_attention(q, k, v, mask)  # [B, H, T, E]
        return self.wo(out.transpose(1, 2).reshape(B, T, H * E))  # [B, T, D]


def grouped_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(E) + mask) v, with G = H/K consecutive query heads per K/V head (Ainslie
    et al. 2023), where the mask adds -inf wherever attention is not allowed.

    q: [B, H, T, E]; k, v: [B, K, S, E]; mask: [T, S] or [B, T, S], True where attention is allowed,
    or None: allowed everywhere (a plain decoding step's one token, which sees the whole cache).
    """
    T, S = q.shape[2], k.shape[2]
    # torch's fused attention (SDPA) computes the formula in one operation, K/V shared by their heads'
    # groups without a copy (`enable_gqa`); written out it is a dozen operations, each a few microseconds
    # of dispatch: on 2 CPU cores, one query token over 300 cached ones took 98 us that way and takes 49
    # with SDPA (float32; bfloat16 135 and 38), and a tree of 64 inputs 713 and 423 (bfloat16 1957 and 239).
    # SDPA turns a boolean mask into an additive one in every call, so an all-True one is not passed: on 2
    # AVX2 cores, one query over 300 cached took 86 us with it and 50 without, the same output bit for bit
    attn_mask = None if mask is None else mask.view(-1, 1, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)  # [B, H, T, E]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matrix."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w_gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, layer, cache, slots, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, layer, cache, slots, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.fingerprint: dict | None = None  # the checkpoint's, set by build_model (artifacts.py checks it)
        self.folder: Path | None = None  # where load_checkpoint found it
        self.early_exit = False  # made by first_layers: its layers are another model's first ones

    @property
    def dtype(self):
        return self.embed.weight.dtype

    @property
    def device(self):
        return self.embed.weight.device

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

    def first_layers(self, count: int) -> "Llama":
        """A draft model for self-speculative decoding: this model's embedding, its first `count`
        layers, then its final norm and LM head (the same tensors, nothing copied). An early exit
        in the spirit of Draft & Verify (Zhang et al. 2024) and LayerSkip (Elhoushi et al. 2024),
        without their training: the shallow hidden state is read by a head trained on the last. Its
        layers' K/V of a text are the model's own, so it can read them from the model's cache
        (kv_cache.FirstLayers)."""
        if not 1 <= count < self.config.num_layers:
            raise UserError(f"a draft needs between 1 and {self.config.num_layers - 1} of the model's "
                            f"{self.config.num_layers} layers, got {count}")
        with torch.device("meta"):
            draft = Llama(dataclasses.replace(self.config, num_layers=count))
        draft.embed, draft.norm, draft.lm_head = self.embed, self.norm, self.lm_head
        draft.layers = nn.ModuleList(self.layers[:count])
        draft.inv_freq = self.inv_freq
        draft.early_exit = True
        return draft.eval()

    def logits_after(self, tokens: list[int], cache) -> torch.Tensor:
        """Feed `tokens`, which follow what `cache` holds (positions cache.length onwards, causal
        attention), into the cache; return the logits [V] after the last of them. A prompt's prefill
        on an empty cache, or a draft model's step."""
        slots = cache.claim(len(tokens))
        positions = torch.arange(slots.start, slots.stop, device=self.device)
        hidden = self.hidden_states(torch.tensor([tokens], device=self.device), positions=positions,
                                    cache=cache, slots=slots)
        return self.logits(hidden[0, -1])

    def logits(self, hidden):
        """[B, T, D] -> [B, T, V]. Kept separate so callers project only the positions they need."""
        return self.lm_head(hidden)

    def forward(self, tokens=None, *, embeds=None, positions, cache=None, slots=None, mask=None):
        """(logits [B, T, V], hidden states [B, T, D]) for every new input."""
        hidden = self.hidden_states(tokens, embeds=embeds, positions=positions, cache=cache, slots=slots,
                                    mask=mask)
        return self.logits(hidden), hidden


def causal_mask(cached: int, new: int, device) -> torch.Tensor:
    """[new, cached + new]: every new token sees the whole cache and the new tokens up to itself."""
    return torch.ones(new, cached + new, dtype=torch.bool, device=device).tril(diagonal=cached)


def room_for_new_tokens(model: Llama, prompt_ids: list[int], max_new_tokens: int) -> int:
    """How many new tokens this prompt may get: `max_new_tokens`, or fewer if the model's context
    (max_position_embeddings) is shorter. The decoding loops (decode.py, apar.py) both ask it."""
    context = model.config.max_positions
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if len(prompt_ids) >= context:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context} (shorten it)")
    return min(max_new_tokens, context - len(prompt_ids))


# ---- loading Hugging Face checkpoints ------------------------------------------------------------

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def load_checkpoint(folder, dtype=torch.float32, device="cpu") -> Llama:
    """A Llama from a Hugging Face folder: config.json + model.safetensors (or sharded with
    model.safetensors.index.json). Pickle checkpoints are refused: unpickling can run arbitrary code."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"model directory {folder} does not exist")
    config = LlamaConfig.from_hf(read_config(folder))
    model = build_model(config, read_safetensors(folder), dtype, device)
    model.folder = folder
    return model


def build_model(config: LlamaConfig, hf: dict[str, torch.Tensor], dtype=torch.float32, device="cpu") -> Llama:
    """A Llama from Hugging Face-named tensors, each checked against the shape the config implies."""
    for name, shape in hf_weight_shapes(config).items():
        if name not in hf:
            raise UserError(f"the checkpoint has no tensor {name}")
        if tuple(hf[name].shape) != shape:
            raise UserError(f"tensor {name} has shape {tuple(hf[name].shape)}, but config.json implies {shape}")
    with torch.device("meta"):
        model = Llama(config)
    state = {name: w.to(device=device, dtype=dtype) for name, w in fused_weights(hf, config).items()}
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inverse_frequencies(config).to(device)
    model.fingerprint = checkpoint_fingerprint(config, hf)
    return model.eval().requires_grad_(False)


def checkpoint_fingerprint(config: LlamaConfig, hf: dict[str, torch.Tensor]) -> dict:
    """What names a checkpoint whatever dtype or device it is loaded in: its shapes and a hash of a few
    weight rows as the checkpoint stores them (in float32, which holds bfloat16 and float16 exactly).
    Trained parts are made for one checkpoint and check this before they are used."""
    last_down = hf[f"model.layers.{config.num_layers - 1}.mlp.down_proj.weight"]
    sample = torch.cat([hf["model.embed_tokens.weight"][:8].flatten(), last_down[:4].flatten()])
    digest = hashlib.sha256(sample.to("cpu", torch.float32).numpy().tobytes()).hexdigest()[:16]
    return {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "num_layers": config.num_layers,
            "weights_sha256": digest}


def require_finite(logits: torch.Tensor, model: Llama) -> torch.Tensor:
    """`logits`, refused if any is NaN or inf: damaged weights (or an overflow in a low precision)
    would otherwise decode to an empty or random answer with no error. The decoding loops check the
    prompt's logits, one device sync per prompt."""
    if not torch.isfinite(logits).all():
        where = f"the weights in {model.folder}" if model.folder else "its weights"
        raise UserError(f"the model computed NaN or inf logits: {where} are damaged (if it is the converted "
                        f"default model, delete that folder and run again to convert it anew) or overflow "
                        f"in {str(model.dtype).removeprefix('torch.')} (try --dtype float32)")
    return logits


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise UserError(f"{folder} has no config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # not UTF-8, or not JSON
        raise UserError(f"{path} is not valid JSON: {err}") from None


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{index} is not a valid index of shards ({type(err).__name__}: {err})") from None
    elif (folder / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise UserError(f"{folder} holds only pickle weights ({', '.join(pickles)}); they are refused "
                            "because loading a pickle can execute code. Convert them to safetensors first.")
        raise UserError(f"{folder} has no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for shard in shards:
        try:
            tensors.update(load_file(folder / shard))
        except (SafetensorError, OSError) as err:
            raise UserError(f"cannot read {folder / shard}: {err}") from None
    return tensors


def hf_weight_shapes(c: LlamaConfig) -> dict[str, tuple]:
    """Every tensor a Hugging Face Llama checkpoint must hold, with the shape its config implies."""
    D, F, V, E = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (c.num_heads * E, D),
            p + "self_attn.k_proj.weight": (c.num_kv_heads * E, D),
            p + "self_attn.v_proj.weight": (c.num_kv_heads * E, D),
            p + "self_attn.o_proj.weight": (D, c.num_heads * E),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
    return shapes


def fused_weights(hf: dict[str, torch.Tensor], c: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> this module's, concatenating q/k/v and gate/up."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    out["lm_head.weight"] = out["embed.weight"] if c.tie_embeddings else hf["lm_head.weight"]
    for i in range(c.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attention_norm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "mlp_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "attention.wqkv.weight"] = torch.cat([hf[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"])
        out[dst + "attention.wo.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "mlp.w_gate_up.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"],
                                                       hf[src + "mlp.up_proj.weight"]])
        out[dst + "mlp.w_down.weight"] = hf[src + "mlp.down_proj.weight"]
    return out
