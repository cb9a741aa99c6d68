"""On a GPU (skipped without CUDA): every method decodes on the device and gives, greedily, exactly
vanilla's tokens, which are the CPU's tokens (float64 tiny models, so nothing rounds differently), and
on the default model in float32 every lossless method equals vanilla on the GPU;
sampling runs with a generator on the device; the command line takes --device cuda."""

import json

import pytest
import torch

from methods.apar import ControlTokens
from programs.cli import main
from backends.cuda_graphs import GraphedModel
from decode import generate
from helpers import (assert_equals_vanilla_greedy, assert_shipped_guesser_equals_vanilla, every_drafter, random_hf_weights,
                     scripted_apar, tiny_artifacts, tiny_hf_config, write_checkpoint, write_tiny_tokenizer)
from checkpoint import build_model, config_from_hf, load_checkpoint
from sampling import Sampling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 16
CONFIG = tiny_hf_config(vocab=VOCAB, max_position_embeddings=96)


def model_on(device):
    return build_model(config_from_hf(CONFIG), random_hf_weights(CONFIG, seed=1), torch.float64, device)


def test_every_method_gives_vanilla_greedy_tokens_on_the_gpu():
    cpu, gpu = model_on("cpu"), model_on("cuda")
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9]):
        expected = generate(cpu, prompt, max_new_tokens=40, eos_ids=set()).token_ids
        assert generate(gpu, prompt, max_new_tokens=40, eos_ids=set()).token_ids == expected
        for name, drafter in every_drafter(gpu).items():
            gen = generate(gpu, prompt, max_new_tokens=40, eos_ids=set(), drafter=drafter)
            assert gen.token_ids == expected, name


def test_every_method_samples_on_the_gpu():
    gpu = model_on("cuda")
    for name, drafter in every_drafter(gpu).items():
        gen = generate(gpu, [3, 1, 4], max_new_tokens=20, eos_ids=set(), drafter=drafter,
                       sampling=Sampling(0.8, top_k=6, top_p=0.95), generator=torch.Generator("cuda").manual_seed(0))
        assert len(gen.token_ids) == 20 and all(0 <= t < VOCAB for t in gen.token_ids), name


def test_apar_threads_compute_on_the_gpu_what_they_compute_on_the_cpu():
    control = ControlTokens(fork=5, child=6)
    script = {"cpu": [], "cuda": []}

    def chooser(device):
        def choose(logits, thread):  # fork after the first token, write two tokens, end
            script[device].append(logits.cpu())
            own = thread.paragraph.tokens
            if len(thread.tokens) == 4 and control.child not in thread.tokens:
                return control.fork
            return 2 if len(own) >= 3 else 7 + len(script[device]) % 8
        return choose

    gens = {device: scripted_apar(chooser(device), model_on(device), [8, 9, 10], control, max_new_tokens=30,
                                  eos_ids={2}) for device in ["cpu", "cuda"]}
    assert gens["cuda"].token_ids == gens["cpu"].token_ids and gens["cuda"].threads == gens["cpu"].threads > 1
    for on_cpu, on_gpu in zip(script["cpu"], script["cuda"], strict=True):
        torch.testing.assert_close(on_gpu, on_cpu, rtol=0, atol=1e-9)


def test_the_command_line_decodes_on_the_gpu(capsys, tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    write_checkpoint(folder, tiny_hf_config(vocab=write_tiny_tokenizer(folder), max_position_embeddings=64))
    tiny_artifacts(folder, tmp_path)
    base = ["--model", str(folder), "--raw", "--prompt", "the quick dog", "--max-new-tokens", "12", "--json",
            "--device", "cuda"]
    results = {}
    for method, extra in [("vanilla", []), ("anpd", []), ("lookahead", []), ("speculative", ["--draft-layers", "1"]),
                          ("medusa", ["--trained", str(tmp_path / "medusa")]),
                          ("ppd", ["--trained", str(tmp_path / "ppd")])]:
        assert main([*base, "--method", method, *extra]) == 0, capsys.readouterr().err
        results[method] = json.loads(capsys.readouterr().out)["token_ids"]
        assert main([*base, "--method", method, *extra, "--temperature", "0.7", "--seed", "1"]) == 0
        capsys.readouterr()
    assert all(ids == results["vanilla"] for ids in results.values()), results


@pytest.mark.parametrize("method", ["anpd", "lookahead", "speculative", "medusa", "ppd"])
def test_the_default_model_on_the_gpu_gives_vanilla_greedy_tokens(method, default_model_dir, default_tokenizer):
    """float32 on the GPU: every lossless method with its shipped parts equals vanilla on the GPU."""
    from methods.registry import METHODS, build_drafter, default_options

    model = load_checkpoint(default_model_dir, torch.float32, "cuda")
    drafter = build_drafter(METHODS[method], default_options(), model, default_tokenizer)
    if method == "speculative":  # guesses from 4 of 30 layers may all fail on two prompts
        for prompt in ["Give me three tips for staying focused while studying.", "Explain what a hash table is."]:
            ids = default_tokenizer.prompt_ids(prompt, raw=False)
            with torch.inference_mode():
                assert_equals_vanilla_greedy(model, ids, 48, default_tokenizer.eos_ids, drafter)
    else:
        assert_shipped_guesser_equals_vanilla(model, default_tokenizer, drafter)


def test_recorded_passes_give_every_methods_vanilla_tokens_on_the_gpu():
    """--cuda-graphs on a tiny float64 model: the graphs are recorded and replayed, and every method
    gives the CPU's vanilla tokens (a prompt longer than the largest bucket is prefilled plainly)."""
    cpu, graphed = model_on("cpu"), GraphedModel(model_on("cuda"))
    recorded, timed = [], []  # per call of the graphed model, whether it recorded a graph; per pass, (seconds, that)
    record, hidden_states = graphed.record, graphed.hidden_states

    def recording(step):
        recorded[-1] = True
        return record(step)

    def calling(*args, **kwargs):
        recorded.append(False)
        return hidden_states(*args, **kwargs)
    graphed.record, graphed.hidden_states = recording, calling
    for prompt in ([3, 1, 4, 1, 5], [(7 * i) % VOCAB for i in range(70)]):
        expected = generate(cpu, prompt, max_new_tokens=24, eos_ids=set()).token_ids
        assert generate(graphed, prompt, max_new_tokens=24, eos_ids=set(),
                        on_pass=lambda done: timed.append((done.seconds, recorded[-1]))).token_ids == expected
        for name, drafter in every_drafter(graphed).items():
            assert generate(graphed, prompt, max_new_tokens=24, eos_ids=set(), drafter=drafter,
                            on_pass=lambda done: timed.append((done.seconds, recorded[-1]))).token_ids == expected, name
    assert len(graphed.passes) > 3 and all(step.graph is not None for step in graphed.passes.values())
    # a pass that recorded its graph timed the recording, not L(n): it measures nothing, and only it
    assert all((seconds == 0) == recorded_it for seconds, recorded_it in timed) and any(r for _, r in timed)


@pytest.mark.parametrize("method", ["vanilla", "anpd", "lookahead", "medusa", "ppd"])
def test_the_default_model_graphed_gives_vanilla_greedy_tokens(method, default_model_dir, default_tokenizer):
    """float32 on the GPU, --cuda-graphs: each method's tokens are the plain model's vanilla tokens."""
    from methods.registry import METHODS, build_drafter, default_options

    model = load_checkpoint(default_model_dir, torch.float32, "cuda")
    graphed = GraphedModel(model)
    for prompt in ["Give me three tips for staying focused while studying.", "Explain what a hash table is."]:
        ids = default_tokenizer.prompt_ids(prompt, raw=False)
        with torch.inference_mode():
            vanilla = generate(model, ids, max_new_tokens=64, eos_ids=default_tokenizer.eos_ids)
            drafter = None if method == "vanilla" else build_drafter(METHODS[method], default_options(), graphed,
                                                                     default_tokenizer)
            replayed = generate(graphed, ids, max_new_tokens=64, eos_ids=default_tokenizer.eos_ids, drafter=drafter)
        assert replayed.token_ids == vanilla.token_ids
    assert graphed.passes
