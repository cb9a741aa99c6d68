"""The tokenizers: the default model's against an independent naive byte-level BPE, round trips,
the chat template, SentencePiece checkpoints, and streaming detokenization."""

import json
from functools import lru_cache

import pytest
from hypothesis import given, strategies as st

from errors import UserError
from tokenizer import StreamDecoder, Tokenizer

FIXED_STRINGS = [
    "Hello world",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Digits: 1234567890, 3.14159, -42, 10e-3, 2024-11-22",
    "runs    of     spaces\t\ttabs\n\n\nnewlines   ",
    "unicode: café naïve 日本語 emoji 🎉🚀 Ωμέγα",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "I'll say they're here, we've done it, you'd know, it's 'quoted' I'm",
    "   leading spaces and trailing   ",
    "",
]


# ---- an independent reference: byte-level BPE written out naively, as in GPT-2 -----------------------

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (so BPE tokens are readable strings)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class NaiveByteLevelBPE:
    def __init__(self, tokenizer_json: dict):
        model = tokenizer_json["model"]
        self.vocab = model["vocab"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        self.rank = {pair: i for i, pair in enumerate(merges)}
        self.specials = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"] if t["special"]}
        self.byte_char = bytes_to_unicode()

    def encode(self, text: str) -> list[int]:
        import regex

        ids = []
        special = "|".join(regex.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        for segment in regex.split(f"({special})", text):
            if segment in self.specials:
                ids.append(self.specials[segment])
                continue
            for piece in regex.split(r"(\p{N})", segment):  # every digit stands alone
                for word in regex.findall(GPT2_PATTERN, piece):
                    pieces = self.bpe("".join(self.byte_char[b] for b in word.encode()))
                    ids += [self.vocab[p] for p in pieces if p in self.vocab]  # no unk: dropped
        return ids

    @lru_cache(maxsize=None)
    def bpe(self, word: str) -> tuple[str, ...]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.rank.get(pair, float("inf")), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            best_rank, i = min(pairs)
            if best_rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return tuple(parts)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return NaiveByteLevelBPE(json.loads((default_model_dir / "tokenizer.json").read_text()))


@pytest.mark.parametrize("text", FIXED_STRINGS)
def test_default_tokenizer_matches_naive_reference(default_tokenizer, reference, text):
    assert default_tokenizer.encode(text) == reference.encode(text)


@given(st.text(max_size=40))
def test_default_tokenizer_matches_reference_on_any_text(default_tokenizer, reference, text):
    assert default_tokenizer.encode(text) == reference.encode(text)


# SmolLM2's vocabulary has no token for 21 bytes (control bytes such as 0x04, and UTF-8 lead bytes
# 0xF1-0xF7 of the rarest planes); text is lossless exactly when its bytes avoid them.
UNSPELLABLE_BYTES = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, *range(0xF1, 0x100)}
spellable_text = st.text(max_size=60).filter(lambda s: not UNSPELLABLE_BYTES & set(s.encode()))


@given(spellable_text)
def test_default_tokenizer_round_trips(default_tokenizer, text):
    # special tokens kept: text that spells one ("<empty_output>", which hypothesis takes from apar.py)
    # is read as that token, as transformers reads it, and decoding drops special tokens by default
    assert default_tokenizer.decode(default_tokenizer.encode(text), skip_special=False) == text


def test_default_tokenizer_drops_bytes_its_vocabulary_lacks(default_tokenizer):
    # U+40000 is F1 80 80 80 in UTF-8; there is no token for F1 and no unknown token, so
    # (as with the checkpoint's own tokenizer) it is dropped rather than encoded
    assert default_tokenizer.encode("\U00040000") == default_tokenizer.encode("\x80")[-1:] * 3


def test_default_tokenizer_known_ids(default_tokenizer):
    # digits are single tokens, and the chat markup maps to its special ids
    assert default_tokenizer.encode("2024") == default_tokenizer.encode("2") + default_tokenizer.encode("0") \
        + default_tokenizer.encode("2") + default_tokenizer.encode("4")
    assert default_tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert default_tokenizer.encode("<|im_start|>user<|im_end|>")[-1] == 2
    assert default_tokenizer.eos_ids == {2}


def test_chat_template_renders_chatml(default_tokenizer):
    assert default_tokenizer.chat_prompt("Hi!") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


# ---- SentencePiece checkpoints ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory):
    import sentencepiece

    folder = tmp_path_factory.mktemp("sp")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog",
                                 "a stitch in time saves nine", "to be or not to be"] * 50))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=320, byte_fallback=True,
        hard_vocab_limit=False,
        model_type="bpe", bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]{% endfor %}"}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


def test_sentencepiece_encodes_with_bos_and_splits_special_tokens(sentencepiece_folder):
    tok = Tokenizer(sentencepiece_folder)
    plain = tok.encode("the fox", add_bos=False)
    assert tok.prompt_ids("the fox", raw=True) == [1] + plain  # --raw adds <s> as Llama does
    chat = tok.prompt_ids("the fox", raw=False)
    assert chat[0] == 1 and chat.count(1) == 1  # the template's literal "<s>" became the BOS id
    assert tok.eos_ids == {2}


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz éü日\n", max_size=30))
def test_sentencepiece_round_trips(sentencepiece_folder, text):
    tok = Tokenizer(sentencepiece_folder)
    # SentencePiece normalises whitespace (runs collapse, the ends are trimmed), so compare normalised
    assert tok.decode(tok.encode(text)) == " ".join(text.split())


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m['content'] }}",  # no endfor
                                      "{{ raise_exception('only user and assistant roles') }}"])
def test_a_broken_chat_template_is_one_error_each_time(sentencepiece_folder, tmp_path, template):
    """A template that does not compile, or raises: one error line, on every prompt (compiled once)."""
    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("tokenizer.model", "config.json"):
        (folder / name).write_bytes((sentencepiece_folder / name).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    tok = Tokenizer(folder)
    for _ in range(2):
        with pytest.raises(UserError, match="the checkpoint's chat template failed"):
            tok.prompt_ids("the fox", raw=False)


# ---- streaming ----------------------------------------------------------------------------------------

@given(spellable_text, st.lists(st.integers(1, 4), max_size=20))
def test_stream_decoder_pieces_add_up_to_the_whole_text(default_tokenizer, text, chunk_sizes):
    ids = default_tokenizer.encode(text)
    stream, printed, i = StreamDecoder(default_tokenizer), "", 0
    for size in chunk_sizes + [len(ids)]:
        printed += stream.push(ids[i:i + size])
        i += size
    printed += stream.flush()
    assert printed == text
