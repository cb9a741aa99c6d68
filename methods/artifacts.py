"""Trained parts (Medusa heads, PPD soft tokens, APAR's adapter) on disk: a small safetensors file of
tensors and, beside it, a JSON file saying how they were made and for which model.

A learned guesser only means something for the model it was trained on, so every artifact records
that model's fingerprint (its shape and a hash of some of its weights) and loading checks it: a
wrong hidden size, vocabulary or model is refused with one line saying what differs, never silently
used. A damaged artifact (truncated, broken JSON, a missing tensor) is one line too.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from errors import UserError
from programs.staging import staged_file

SHIPPED = Path(__file__).resolve().parent.parent / "trained"  # artifacts for the default model, in the repository


def shipped_artifact(kind: str, model_folder: Path) -> Path:
    """Where train_prompt.py saves, and decoding looks for, the `kind` artifact of a model's folder."""
    return SHIPPED / f"{kind}-{model_folder.name}"


def model_fingerprint(model) -> dict:
    """What an artifact must match: the checkpoint the model was loaded from (its shapes and a hash of
    some of its weights as stored, model.Llama.fingerprint), whatever dtype or device it runs in."""
    if model.fingerprint is None:
        raise ValueError("this model was not loaded from a checkpoint, so it has no fingerprint")
    return model.fingerprint


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """path.safetensors + path.json, each written whole to a temporary name first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(path.with_suffix(".safetensors")) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp)
    with staged_file(path.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def kind_of(path: Path) -> str | None:
    """The kind its JSON says the artifact at `path` is ("ppd", "eagle", ...), or None where it cannot
    say (missing or unreadable: `load` then says what is wrong)."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    return meta.get("kind") if isinstance(meta, dict) else None


def load(path: Path, kind: str, model) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and metadata at `path` (.safetensors + .json), checked to be a `kind` artifact
    made for `model`; tensors on the model's device and dtype."""
    weights, meta_file = path.with_suffix(".safetensors"), path.with_suffix(".json")
    if not weights.is_file() or not meta_file.is_file():
        raise UserError(f"no {kind} artifact at {path} (expected {weights.name} and {meta_file.name}); "
                        f"train one with: python train_prompt.py {kind}")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:  # not UTF-8, not JSON, unreadable
        raise broken(meta_file, kind, err) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise broken(meta_file, kind, "no model fingerprint in it")
    if meta.get("kind") != kind:
        raise UserError(f"{weights} holds {meta.get('kind')!r} weights, not {kind!r}")
    expected, found = model_fingerprint(model), meta["model"]
    differs = [key for key in expected if found.get(key) != expected[key]]
    if differs and differs != ["weights_sha256"]:
        raise UserError(f"{weights} was trained for another model: " + ", ".join(
            f"{key} {found.get(key)} there, {expected[key]} here" for key in differs if key != "weights_sha256")
            + f"; train one for this model with: python train_prompt.py {kind}")
    if differs:
        raise UserError(f"{weights} was trained for a model of the same shape with other weights (fingerprint "
                        f"{found.get('weights_sha256')} there, {expected['weights_sha256']} here); train one "
                        f"for this model with: python train_prompt.py {kind}")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as err:  # truncated, not safetensors, unreadable
        raise broken(weights, kind, err) from None
    return {k: v.to(model.device, model.dtype) for k, v in tensors.items()}, meta


def broken(path: Path, kind: str, reason) -> UserError:
    restore = f"`git checkout {path.relative_to(SHIPPED.parent)}`" if path.is_relative_to(SHIPPED) else "delete it"
    return UserError(f"{path} is not a readable {kind} artifact ({first_line(reason)}); {restore}, or train "
                     f"one again with: python train_prompt.py {kind}")


def first_line(reason) -> str:
    return str(reason).strip().splitlines()[0] if str(reason).strip() else type(reason).__name__


@contextmanager
def unpacking(path: Path, kind: str) -> Iterator[None]:
    """Around building a method's parts from an artifact's contents: a tensor or key that is missing
    or has the wrong shape or type is a broken artifact (one line), not a traceback."""
    try:
        yield
    except NotImplementedError:  # (a RuntimeError) unwritten code, such as a course starter's: not the artifact's fault
        raise
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as err:
        raise broken(path.with_suffix(".safetensors"), kind, f"{type(err).__name__}: {first_line(err)}") from None
