"""The tests' fixtures: a tiny checkpoint folder, and the real default model converted once per session.
The helpers the tests share with the course's graders are in helpers.py."""

import os

import pytest
import torch

from helpers import tiny_hf_config, write_checkpoint, write_tiny_tokenizer

# Under `-n auto` (pytest-xdist), each worker and the programs it starts get their share of the cores:
# more torch threads than cores wait for each other (course/conftest.py: a grader that takes 1 s alone
# took 90 s beside two others).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
    torch.set_num_threads(THREADS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory):
    """The tests' own cache folder (the default model converted into it once): no test reads or changes
    the user's, whose saved L(n) and calibrations would otherwise steer cost-aware drafting in the tests,
    and be rewritten by them. Subprocesses inherit it."""
    os.environ["SPECDEC_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny random checkpoint with a real (tiny) tokenizer, as a folder --model can name."""
    folder = tmp_path_factory.mktemp("tiny")
    vocab = write_tiny_tokenizer(folder)
    write_checkpoint(folder, tiny_hf_config(vocab=vocab, eos_token_id=2, max_position_embeddings=64))
    return folder


@pytest.fixture(scope="session")
def default_model_dir():
    from programs.convert import default_model_dir as convert_once

    return convert_once()


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    from checkpoint import load_checkpoint

    return load_checkpoint(default_model_dir, torch.float32)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from tokenizer import Tokenizer

    return Tokenizer(default_model_dir)
