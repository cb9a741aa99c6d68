"""Trained parts (Medusa heads, PPD soft tokens, APAR's adapter) on disk: a small safetensors file of
tensors and, beside it, a JSON file saying how they were made and for which model.

A learned guesser only means something for the model it was trained on, so every artifact records
that model's fingerprint (its shape and a hash of some of its weights) and loading checks it: a
wrong hidden size, vocabulary or model is refused with one line, never silently used.
"""

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from errors import UserError

SHIPPED = Path(__file__).resolve().parent / "trained"  # artifacts for the default model, in the repository


def shipped_artifact(kind: str, model_folder: Path) -> Path:
    """Where train_prompt.py saves, and decoding looks for, the `kind` artifact of a model's folder."""
    return SHIPPED / f"{kind}-{model_folder.name}"


def model_fingerprint(model) -> dict:
    """What an artifact must match: the shapes it is built on, and a hash of a few weight rows (the
    same architecture with other weights is another model)."""
    c = model.config
    sample = torch.cat([model.embed.weight[:8].flatten(), model.layers[-1].mlp.w_down.weight[:4].flatten()])
    digest = hashlib.sha256(sample.detach().to("cpu", torch.float32).numpy().tobytes()).hexdigest()[:16]
    return {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_layers": c.num_layers,
            "weights_sha256": digest}


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """path.safetensors + path.json, each written whole to a temporary name first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp)
    tmp.replace(path.with_suffix(".safetensors"))
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(path.with_suffix(".json"))


def load(path: Path, kind: str, model) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and metadata at `path` (.safetensors + .json), checked to be a `kind` artifact
    made for `model`; tensors on the model's device and dtype."""
    weights, meta_file = path.with_suffix(".safetensors"), path.with_suffix(".json")
    if not weights.is_file() or not meta_file.is_file():
        raise UserError(f"no {kind} artifact at {path} (expected {weights.name} and {meta_file.name}); "
                        f"train one with: python train_prompt.py {kind}")
    meta = json.loads(meta_file.read_text())
    if meta.get("kind") != kind:
        raise UserError(f"{weights} holds {meta.get('kind')!r} weights, not {kind!r}")
    expected, found = model_fingerprint(model), meta.get("model", {})
    for key in ("hidden_size", "vocab_size"):
        if found.get(key) != expected[key]:
            raise UserError(f"{weights} was trained for a model with {key} {found.get(key)}, this model "
                            f"has {expected[key]}; train one for it with: python train_prompt.py {kind}")
    if found != expected:
        raise UserError(f"{weights} was trained for another model (fingerprint {found.get('weights_sha256')}, "
                        f"this one {expected['weights_sha256']}); train one with: python train_prompt.py {kind}")
    tensors = {k: v.to(model.device, model.dtype) for k, v in load_file(weights).items()}
    return tensors, meta
