"""Loading a Hugging Face Llama checkpoint (config.json and safetensors) into model.py's `Llama`,
every value and tensor shape checked first: a wrong one is one `error:` line naming it, not a crash
deep in the forward pass. Pickle checkpoints are refused: unpickling can run arbitrary code.

    model = load_checkpoint("path/to/SmolLM2-135M-Instruct", torch.float32, "cpu")
"""

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from errors import UserError
from model import Llama, LlamaConfig, rope_inverse_frequencies

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


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def load_checkpoint(folder, dtype=torch.float32, device="cpu") -> Llama:
    """A Llama from a Hugging Face folder: config.json + model.safetensors (or sharded with
    model.safetensors.index.json). Pickle checkpoints are refused: unpickling can run arbitrary code."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"model directory {folder} does not exist")
    config = config_from_hf(read_config(folder))
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
def config_from_hf(hf: dict) -> LlamaConfig:
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
    config = LlamaConfig(
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
    check_rope_scaling(scaling)  # an unsupported rope_scaling refused now, not mid-generation
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


ROPE_SCALING_KEYS = {"linear": ["factor"],
                     "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]}


def check_rope_scaling(scaling) -> None:
    """A config's rope_scaling, checked to be one model.rope_inverse_frequencies computes."""
    if not scaling:
        return
    if not isinstance(scaling, dict):
        raise UserError(f"config.json: rope_scaling must be an object or null, got {json.dumps(scaling)}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALING_KEYS:
        raise UserError(f"rope_scaling type {kind!r} is not supported (only 'linear' and 'llama3')")
    for key in ROPE_SCALING_KEYS[kind]:
        config_entry(scaling, key, float, within="rope_scaling.")
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise UserError("config.json: rope_scaling's low_freq_factor must be below its high_freq_factor")
