"""train_prompt.py: an interrupted training run resumes to exactly the weights of an uninterrupted
one, bad options are refused with one line before any work, and APAR stops an answer once it loops."""

import pytest
import torch

import train_prompt
from helpers import self_distilled_record, tiny_model
from methods.ppd import SoftTokens, initial_embeddings
from training.self_distill import base_pass

VOCAB = 16


def test_training_resumes_where_it_stopped(tmp_path, monkeypatch):
    """An interrupted run, run again, ends with exactly the weights of an uninterrupted one."""
    import argparse

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    record = self_distilled_record(model, 0, VOCAB)

    def train(out, stop_at=None):
        args = argparse.Namespace(out=tmp_path / out, save_every=2, lr=0.05, seed=0)
        soft_tokens = SoftTokens(initial_embeddings(model, 2, 1, seed=0).double())
        optimizer = torch.optim.AdamW(soft_tokens.parameters(), lr=args.lr)

        def step_loss(step):
            if step == stop_at:
                raise KeyboardInterrupt
            return train_prompt.ppd_record_loss(model, soft_tokens, record, 8, torch.Generator().manual_seed(step)), 1

        train_prompt.run_steps(soft_tokens, optimizer, 6, step_loss, args)
        return soft_tokens.embeddings.detach(), args.runs

    straight, one_run = train("straight")
    with pytest.raises(KeyboardInterrupt):
        train("interrupted", stop_at=5)  # the resume point of step 4 was saved
    resumed, two_runs = train("interrupted")
    assert torch.equal(resumed, straight)
    # the record counts each run's steps up to its last resume point: step 5 of the first was lost
    assert [run["steps"] for run in one_run] == [[0, 6]] and [run["steps"] for run in two_runs] == [[0, 4], [4, 6]]
    assert all(run["seconds"] >= 0 and "cores" in run["machine"] for run in one_run + two_runs)


def test_a_resume_point_that_does_not_record_its_runs_is_not_resumed(tmp_path, capsys):
    """An older version's resume point: resuming it would leave its steps' time out of the record."""
    path = tmp_path / "old.resume.pt"
    torch.save({"settings": {}, "step": 3}, path)
    assert train_prompt.read_resume_point(path) is None
    assert "of an older version; starting over" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["ppd", "--epochs", "0"], "--epochs"), (["medusa", "--lr", "0"], "--lr"), (["ppd", "--lr", "nan"], "--lr"),
    (["apar", "--lr", "inf"], "--lr"), (["ppd", "--records", "5"], "--records"), (["medusa", "--heads", "9"], "1..7"),
    (["ppd", "--epochs", "1" + "0" * 30], "--epochs"), (["ppd", "--soft-tokens", "8", "--ensembles", "16"], "64"),
    (["apar", "--answers", "humans"], "--answers"), (["apar", "--answers", "sharegpt", "--sampled-answers", "2"], "--sampled-answers"),
    (["apar", "--answers", "sharegpt", "--answer-batch", "8"], "--answer-batch"),
    (["eagle", "--steps", "0"], "--steps"), (["eagle", "--answers", "humans"], "--answers"),
    (["eagle", "--draft-vocab", "0"], "--draft-vocab"),
])
def test_training_options_are_checked_before_any_work(capsys, argv, fragment):
    try:
        code = train_prompt.main(argv)
    except SystemExit as exit:  # a usage error (argparse)
        code = exit.code
    err = capsys.readouterr().err
    assert code != 0 and err.count("error:") == 1 and fragment in err and "Traceback" not in err


def test_an_output_path_that_cannot_be_written_is_refused_before_training(capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    assert train_prompt.main(["ppd", "--out", str(tmp_path / "a-file" / "ppd")]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "a-file is a file, not a folder" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing left behind


def test_each_subcommand_has_its_own_defaults():
    """APAR's longer answers and Medusa's epochs must not become PPD's (argparse shares a parent
    parser's options between subcommands, so set_defaults on one changed them for all)."""
    parser = train_prompt.build_parser()
    ppd, medusa, apar = (vars(parser.parse_args([name])) for name in ["ppd", "medusa", "apar"])
    assert (ppd["records"], ppd["max_new_tokens"], ppd["max_prompt_tokens"], ppd["epochs"]) == (480, 192, 192, 1)
    assert (medusa["records"], medusa["epochs"]) == (480, 4)
    assert (apar["records"], apar["max_new_tokens"], apar["max_prompt_tokens"], apar["epochs"]) == (3000, 512, 192, 2)
    assert vars(parser.parse_args(["data"]))["records"] == 480
    eagle = vars(parser.parse_args(["eagle"]))
    assert (eagle["records"], eagle["epochs"], eagle["answers"], eagle["steps"]) == (4000, 5, "sharegpt", 2)


def test_eagle_features_are_cached_in_parts_and_a_stopped_run_reuses_the_finished_ones(tmp_path, monkeypatch):
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    records = [self_distilled_record(model, seed, VOCAB) for seed in range(5)]
    monkeypatch.setattr(train_prompt, "FEATURE_CHUNK", 2)
    path = tmp_path / "features.safetensors"
    whole = train_prompt.cached_sequence_features(model, records, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"features-{k}.safetensors" for k in range(3)]
    (tmp_path / "features-1.safetensors").unlink()  # stopped while making the second part
    passes = []
    monkeypatch.setattr(train_prompt, "base_pass", lambda model, ids: passes.append(ids) or base_pass(model, ids))
    again = train_prompt.cached_sequence_features(model, records, path)
    assert passes == [records[2]["prompt_ids"] + records[2]["answer_ids"],
                      records[3]["prompt_ids"] + records[3]["answer_ids"]]
    for (features, tokens, start), (features_again, tokens_again, start_again) in zip(whole, again, strict=True):
        assert torch.equal(features, features_again) and torch.equal(tokens, tokens_again) and start == start_again
    assert whole[1][1].tolist() == records[1]["prompt_ids"] + records[1]["answer_ids"]
    assert whole[1][2] == len(records[1]["prompt_ids"])


def test_apar_stops_an_answer_once_it_loops():
    """APAR's answers are stopped when the data rules would call them repetitive, not before."""
    class Letters:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    stop = train_prompt.apar_answer_stop(Letters())
    points = [ord(c) for c in "".join(f"{n}. point number {n} of the list\n" for n in range(1, 6))]
    loop = [ord(c) for c in "1. the same line again\n" * 6]
    assert not stop(points) and stop(points + loop)


@pytest.mark.parametrize("records, rank, adapt, fragment", [
    (None, 4, [], "no apar artifact at"), (600, 4, [], "was trained with --records 600, this round has 3000"),
    (3000, 8, [], "has rank 4; give --rank 4"),
    (3000, 4, ["--adapt", "mlp.w_down"], "adapts attention.wqkv attention.wo; give --adapt attention.wqkv attention.wo")])
def test_an_adapter_to_continue_from_is_checked_before_any_work(capsys, tmp_path, tiny_folder, records, rank, adapt,
                                                                fragment):
    """--from-adapter must have held out the prompts this round holds out, and have its rank and its
    adapted projections (read from its tensors, as decoding merges them)."""
    from methods import artifacts
    from checkpoint import load_checkpoint

    model = load_checkpoint(tiny_folder, torch.float32, torch.device("cpu"))
    if records is not None:
        meta = {"kind": "apar", "model": artifacts.model_fingerprint(model),
                "training": {"settings": {"records": records, "max_prompt_tokens": 192}}}
        lora = {f"layers.0.attention.{name}.{part}": torch.zeros(shape) for name in ("wqkv", "wo")
                for part, shape in (("up", (8, 4)), ("down", (4, 8)))}
        artifacts.save(tmp_path / "earlier", {"control_embeddings": torch.zeros(2, 8), **lora}, meta)
    code = train_prompt.main(["apar", "--model", str(tiny_folder), "--from-adapter", str(tmp_path / "earlier"),
                              "--rank", str(rank), "--out", str(tmp_path / "new"), *adapt])
    err = capsys.readouterr().err
    assert code == 1 and err.count("error:") == 1 and fragment in err and "Traceback" not in err
    assert "self-distilled" not in err  # refused before the answers are made


def test_structured_lists_trains_a_list_prompt_only_on_answers_with_structure(monkeypatch, tmp_path, default_tokenizer):
    """--answers structured-lists: on a list-style prompt only structured answers are kept, whichever
    source wrote them (the model or ShareGPT); on any other prompt the model's answers all stay, so
    the negatives come from prompts that ask for no list. ShareGPT is not asked about other prompts."""
    import argparse

    tok = default_tokenizer
    eos = min(tok.eos_ids)
    points = ("Here are some tips:\n\n1. **Keep a schedule:** Go to bed at the same time every night.\n"
              "2. Light: Keep the room dark and quiet.\n3. Screens: Put the phone away an hour before bed.")
    prose = "Twelve sevens are eighty-four, since ten sevens make seventy and two more make fourteen."
    paragraphs = ("A themed party is always fun. Pick one idea and dress the room to match it.\n\nGames keep "
                  "everyone busy. Plan a treasure hunt or a quiz for the guests.\n\nFood matters most of all. "
                  "Bake a cake together and order a few pizzas.")
    tips, ideas, sum_, poem = ("List five tips for sleeping well.", "Give me some ideas for a birthday party.",
                               "What is 12 times 7?", "Write a short poem about rain.")
    by_model = {tips: points, ideas: prose, sum_: prose, poem: points}
    by_sharegpt = {tips: prose, ideas: paragraphs}  # paragraphs are structure too

    def record(prompt, text):
        return {"prompt_ids": tok.prompt_ids(prompt, raw=False), "answer_ids": tok.encode(text) + [eos]}

    monkeypatch.setattr(train_prompt, "apar_prompts", lambda count, tokenizer, longest: [tips, ideas, sum_, poem])
    monkeypatch.setattr(train_prompt, "held_out_prompts", lambda tokenizer, prompts: [])
    monkeypatch.setattr(train_prompt, "data_file", lambda model, folder, args, prompts="": tmp_path / f"a{prompts}")
    monkeypatch.setattr(train_prompt, "generate_answers",
                        lambda model, tokenizer, path, prompts, **how: [record(p, by_model[p]) for p in prompts])
    monkeypatch.setattr(train_prompt, "recorded_answers",
                        lambda tokenizer, prompts, longest: [record(p, by_sharegpt[p]) for p in prompts])
    args = argparse.Namespace(command="apar", answers="structured-lists", records=4, max_prompt_tokens=64,
                              max_new_tokens=64, answer_batch=2, sampled_answers=0)
    training, held_out = train_prompt.answers(None, tok, tmp_path, args)
    asked = {tuple(tok.prompt_ids(p, raw=False)): p for p in (tips, ideas, sum_, poem)}
    kept = sorted((asked[tuple(r["prompt_ids"])], tok.decode(r["answer_ids"][:-1])) for r in training)
    assert held_out == [] and kept == sorted([(tips, points), (ideas, paragraphs), (sum_, prose), (poem, points)])


def test_sharegpt_points_keeps_the_recorded_roots_and_writes_the_details_in_the_models_words(
        monkeypatch, tmp_path, default_tokenizer):
    """--answers sharegpt-points: a list-style prompt's structured ShareGPT reply keeps its roots, and
    each detail is what the model wrote after the answer so far and that root, up to its line's end;
    the closing text is the model's too. A reply whose detail runs on without ending its line is
    dropped, so is one without structure; the model's EOS after a detail ends the answer there. Other
    prompts keep the model's own answers, and ShareGPT is not asked about them."""
    import argparse

    tok = default_tokenizer
    eos = min(tok.eos_ids)
    tips, ideas, chores, poem = ("List three tips for sleeping well.", "Give me some ideas for a party.",
                                 "List the steps of cleaning a kitchen.", "Write a short poem about rain.")
    replies = {
        tips: "Here are some tips:\n\n1. **Schedule:** Go to bed at ten.\n2. Light: Keep it dark.\n"
              "3. Screens: No phone at night.\n\nSleep well!",
        ideas: "1. Games: Play a quiz with the guests.\n2. Food: Bake a cake together.\n"
               "3. Music: Ask a friend to play.\n4. Gifts: Wrap them the night before.",
        chores: "1. Dishes: Wash them first.\n2. Counters: Wipe them down.\n3. Floor: Mop it last.",
        poem: "Rain on the roof. Rain on the road.\n\nRain in my heart.",  # not asked: not list-style
    }
    asked_sharegpt = []

    def sharegpt_answers(prompts):
        asked_sharegpt.extend(prompts)
        return {p: replies[p] for p in prompts}

    def continuations(model, contexts, max_new_tokens, ends, args, stop=None):
        out = []
        for context in contexts:
            text = tok.decode(context)
            if "Music:" in text:  # a detail that never ends its line
                out.append(tok.encode(" la" * max_new_tokens)[:max_new_tokens])
            elif "Counters:" in text:  # the model ends its answer after this detail
                out.append(tok.encode(" Wipe every counter with a damp cloth.") + [eos])
            elif ends == tok.eos_ids:  # the closing text
                out.append(tok.encode("Those are my tips, and they work.") + [eos])
            else:
                out.append(tok.encode(" as the model would say it in its words.\n"))
        return out

    monkeypatch.setattr(train_prompt, "apar_prompts", lambda count, tokenizer, longest: [tips, ideas, chores, poem])
    monkeypatch.setattr(train_prompt, "held_out_prompts", lambda tokenizer, prompts: [])
    monkeypatch.setattr(train_prompt, "data_file", lambda model, folder, args, prompts="": tmp_path / f"a{prompts}")
    monkeypatch.setattr(train_prompt, "generate_answers", lambda model, tokenizer, path, prompts, **how: [
        {"prompt_ids": tok.prompt_ids(p, raw=False), "answer_ids": tok.encode("Rain falls.") + [eos]} for p in prompts])
    monkeypatch.setattr(train_prompt, "sharegpt_answers", sharegpt_answers)
    monkeypatch.setattr(train_prompt, "continuations", continuations)
    args = argparse.Namespace(command="apar", answers="sharegpt-points", records=4, max_prompt_tokens=64,
                              max_new_tokens=256, answer_batch=2, sampled_answers=0)
    training, held_out = train_prompt.answers(None, tok, tmp_path, args)
    asked = {tuple(tok.prompt_ids(p, raw=False)): p for p in (tips, ideas, chores, poem)}
    kept = {asked[tuple(r["prompt_ids"])]: tok.decode(r["answer_ids"][:-1]) for r in training}
    assert held_out == [] and sorted(asked_sharegpt) == sorted([tips, ideas, chores])
    said = " as the model would say it in its words."
    assert kept == {
        tips: f"Here are some tips:\n\n1. **Schedule:**{said}\n2. Light:{said}\n3. Screens:{said}\n\n"
              "Those are my tips, and they work.",
        chores: f"1. Dishes:{said}\n2. Counters: Wipe every counter with a damp cloth.",
        poem: "Rain falls.",
    }
    assert [p.root for p in train_prompt.structure(kept[tips]).points] == [
        p.root for p in train_prompt.structure(replies[tips]).points]
    assert (tmp_path / "a-sharegpt-points").is_file()  # made once: the next round reads it


def test_continuations_come_in_the_contexts_order_and_none_are_asked_of_no_context():
    """A round of ShareGPT's points that no reply reaches asks nothing (the round after the longest
    reply still being written ended would otherwise reach answer_stream with no prompt)."""
    import argparse

    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    args = argparse.Namespace(answer_batch=2)
    contexts = [[1, 2, 3], [4], [5, 6]]
    assert train_prompt.continuations(model, [], 8, {0}, args) == []
    together = train_prompt.continuations(model, contexts, 8, {0}, args)
    assert together == [train_prompt.continuations(model, [c], 8, {0}, args)[0] for c in contexts]
