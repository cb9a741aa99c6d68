"""Nothing left behind (staging.py): a file or folder is whole under its name or absent; a writer
stopped by an exception removes its staging entry, and one killed outright (SIGKILL) leaves one that
the next run removes, proven dead by its lock, never another live writer's. The default model's
conversion and a training run are killed at several points; after the next run the cache and the
output folder hold nothing but finished files, and what they hold is what an unkilled run makes."""

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from programs import convert
from programs import staging
from helpers import ROOT

TESTS = ROOT / "tests"


def staging_entries(folder):
    return sorted(p.name for p in folder.rglob("*") if staging.MARK in p.name)


def test_a_staged_file_is_whole_or_absent(tmp_path):
    target = tmp_path / "table.json"
    with staging.staged_file(target) as tmp:
        tmp.write_text("whole")
        assert not target.exists() and staging.MARK in tmp.name
    assert target.read_text() == "whole"
    with pytest.raises(OSError), staging.staged_file(target) as tmp:
        tmp.write_text("half")
        raise OSError("disk full")
    assert target.read_text() == "whole" and staging_entries(tmp_path) == []


def test_a_live_writers_entry_is_never_swept(tmp_path):
    with staging.staged_file(tmp_path / "a") as tmp:  # locked by this (live) process
        tmp.write_text("writing")
        assert staging.remove_stale(tmp_path) == [] and tmp.exists()
    young = tmp_path / f".b{staging.MARK}{os.getpid()}-0000"  # created, not yet locked, by a live pid
    young.write_text("")
    assert staging.remove_stale(tmp_path) == []


def test_a_dead_writers_entry_is_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    entry = tmp_path / f".c{staging.MARK}{int(dead.stdout)}-0000"
    (entry / "inside").mkdir(parents=True)
    assert staging.remove_stale(tmp_path) == [entry] and not entry.exists()
    reused = tmp_path / f".d{staging.MARK}{os.getpid()}-0000"  # a live pid, but an old unlocked entry
    reused.write_text("")
    os.utime(reused, (time.time() - 2 * staging.GRACE_SECONDS,) * 2)
    assert staging.remove_stale(tmp_path) == [reused]


KILLED_CONVERSION = """
import os, signal, sys
sys.path.insert(0, {root!r})
from programs import convert, staging

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

point = {point!r}
if point == "dequantizing":  # after some tensors
    real = convert.dequantized_tensors
    convert.dequantized_tensors = lambda reader, config, progress: real(
        reader, config, lambda done, total: die() if done == 100 else progress(done, total))
elif point == "writing the weights":  # half of model.safetensors written
    def half(tensors, path, metadata=None):
        open(path, "wb").write(b"x" * 1000)
        die()
    convert.save_file = half
elif point == "writing the stamp":  # everything but conversion.json written
    real_write_json = convert.write_json
    convert.write_json = lambda path, obj: die() if path.name == "conversion.json" else real_write_json(path, obj)
elif point == "renaming":  # the staging folder complete, not yet renamed
    staging.os.replace = die
convert.default_model_dir()
"""


def test_a_killed_conversion_leaves_nothing_once_the_next_run_is_done(tmp_path, default_model_dir):
    env = os.environ | {"SPECDEC_CACHE": str(tmp_path)}
    points = ["dequantizing", "writing the weights", "writing the stamp", "renaming"]
    for point in points:
        killed = subprocess.run([sys.executable, "-c", KILLED_CONVERSION.format(root=str(ROOT), point=point)],
                                env=env, capture_output=True, text=True)
        assert killed.returncode == -9, (point, killed.stderr)
        assert len(staging_entries(tmp_path)) == 1  # its own: it removed the one the kill before left
        assert not (tmp_path / convert.DEFAULT_MODEL_NAME).exists()
    after = subprocess.run([sys.executable, "-c", KILLED_CONVERSION.format(root=str(ROOT), point="none")],
                           env=env, capture_output=True, text=True)
    assert after.returncode == 0, after.stderr
    assert after.stderr.count("left in the cache by a run that was killed") == 1
    assert staging_entries(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [convert.DEFAULT_MODEL_NAME, convert.DEFAULT_MODEL_NAME + ".lock"]
    converted = tmp_path / convert.DEFAULT_MODEL_NAME
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:  # the same model, so the same answers
        assert sha256(converted / name) == sha256(default_model_dir / name), name


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


KILLED_TRAINING = """
import argparse, os, signal, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch
import train_prompt
from methods import artifacts
from helpers import self_distilled_record, tiny_model
from methods.ppd import SoftTokens, initial_embeddings

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

point, out = {point!r}, {out!r}
model = tiny_model(0, vocab=16, max_positions=96)
record = self_distilled_record(model, 0, 16)
args = argparse.Namespace(out=artifacts.Path(out), save_every=2, lr=0.05, seed=0)
soft_tokens = SoftTokens(initial_embeddings(model, 2, 1, seed=0).double())
optimizer = torch.optim.AdamW(soft_tokens.parameters(), lr=args.lr)
if point == "writing a resume point":  # the second one, half written
    real_save, saves = torch.save, []
    def half(obj, path):
        saves.append(path)
        if len(saves) == 2:
            open(path, "wb").write(b"x" * 100)
            die()
        real_save(obj, path)
    train_prompt.torch.save = half
elif point == "writing the result":  # the tensors file half written
    def half(tensors, path):
        open(path, "wb").write(b"x" * 100)
        die()
    artifacts.save_file = half

def step_loss(step):
    if point == "between resume points" and step == 5:
        die()
    return train_prompt.ppd_record_loss(model, soft_tokens, record, 8, torch.Generator().manual_seed(step)), 1

train_prompt.run_steps(soft_tokens, optimizer, 6, step_loss, args)
artifacts.save(args.out, {{"embeddings": soft_tokens.embeddings.detach()}}, {{"kind": "ppd"}})
"""


@pytest.mark.parametrize("point", ["writing a resume point", "between resume points", "writing the result"])
def test_a_killed_training_run_leaves_nothing_once_the_next_run_is_done(tmp_path, point):
    env = os.environ | {"SPECDEC_CACHE": str(tmp_path / "cache")}

    def run(point, out):
        script = KILLED_TRAINING.format(root=str(ROOT), tests=str(TESTS), point=point, out=str(tmp_path / "out" / out))
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    killed = run(point, "killed")
    assert killed.returncode == -9, killed.stderr
    assert run("none", "killed").returncode == 0
    assert run("none", "straight").returncode == 0
    assert staging_entries(tmp_path) == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "killed.json", "killed.safetensors", "straight.json", "straight.safetensors"]
    assert json.loads((tmp_path / "out" / "killed.json").read_text()) == {"kind": "ppd"}
    assert torch.equal(load_file(tmp_path / "out" / "killed.safetensors")["embeddings"],
                       load_file(tmp_path / "out" / "straight.safetensors")["embeddings"])
