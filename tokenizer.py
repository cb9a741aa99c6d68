"""Text <-> token ids for a checkpoint folder, its chat template, its stop tokens, and streaming.

Two tokenizer formats are read, as Hugging Face checkpoints ship them:
- `tokenizer.json` (the `tokenizers` library: byte-level BPE such as SmolLM2 and Llama 3);
- `tokenizer.model` (SentencePiece, such as Llama 2), where special tokens written in the text are
  split out first and each remaining piece is encoded on its own (transformers' "legacy" behaviour).

The chat template is the checkpoint's own Jinja template, rendered the way transformers'
`apply_chat_template` does (sandboxed, trim_blocks and lstrip_blocks, `raise_exception`).
"""

import functools
import json
import re
from datetime import datetime
from pathlib import Path

from errors import UserError


class Tokenizer:
    def __init__(self, folder: Path):
        folder = Path(folder)
        self.config = read_json_if_exists(folder / "tokenizer_config.json")
        if (folder / "tokenizer.json").exists():
            self.backend = HFTokenizersBackend(folder / "tokenizer.json")
        elif (folder / "tokenizer.model").exists():
            self.backend = SentencePieceBackend(folder / "tokenizer.model", self.config)
        else:
            raise UserError(f"{folder} has no tokenizer.json or tokenizer.model")
        self.vocab_size = self.backend.vocab_size
        if self.vocab_size == 0:  # every answer would be silently empty
            raise UserError(f"{folder}: the tokenizer's vocabulary is empty")
        self.chat_template = chat_template(self.config, folder)
        self.eos_ids = stop_token_ids(folder, self)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return self.backend.encode(text, add_bos)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special)

    def vocabulary(self) -> list[str]:
        """Every token's string, by id: two tokenizers with equal vocabularies map text alike."""
        return [self.backend.id_to_token(i) for i in range(self.vocab_size)]

    def token_id(self, token: str) -> int | None:
        """The id of the token spelled `token` ("<|im_end|>"), None if there is none."""
        return self.backend.token_to_id(token)

    def special_token(self, name: str) -> str | None:
        """The string of a special token named in tokenizer_config.json ("bos_token", ...)."""
        value = self.config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else None

    def chat_prompt(self, user_text: str) -> str:
        """The prompt as the chat template renders one user turn, ready for the assistant's reply."""
        if not self.chat_template:
            raise UserError("this checkpoint has no chat template; pass --raw to feed the prompt as-is")
        return render_chat_template(self.chat_template, [{"role": "user", "content": user_text}],
                                    {n: self.special_token(n) for n in
                                     ("bos_token", "eos_token", "unk_token", "pad_token")})

    def prompt_ids(self, text: str, raw: bool) -> list[int]:
        """Token ids for a prompt: as-is (with BOS where the tokenizer adds one), or via the chat template.
        A rendered template already spells out its special tokens, so none are added then."""
        if raw:
            return self.encode(text, add_bos=self.config.get("add_bos_token", self.backend.default_add_bos))
        return self.encode(self.chat_prompt(text))


def chat_template(config: dict, folder: Path) -> str | None:
    """tokenizer_config.json's chat template: a string, or a list of named ones (the "default" one)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str | None):
        raise UserError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string, or a list "
                        'of {"name", "template"} objects with a "default" one')
    return template


def read_json_if_exists(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # not UTF-8, or not JSON
        raise UserError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(found, dict):
        raise UserError(f"{path} is not a JSON object")
    return found


def stop_token_ids(folder: Path, tokenizer: "Tokenizer") -> set[int]:
    """Generation stops at these ids: generation_config.json's eos_token_id (an int or a list) as
    transformers' generate uses it, else config.json's, else the tokenizer's eos token."""
    for name in ("generation_config.json", "config.json"):
        eos = read_json_if_exists(folder / name).get("eos_token_id")
        if eos is not None:
            ids = eos if isinstance(eos, list) else [eos]
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tokenizer.vocab_size for i in ids):
                raise UserError(f"{folder / name}: eos_token_id must be a token id (0..{tokenizer.vocab_size - 1}) "
                                f"or a list of them, got {json.dumps(eos)}")
            return set(ids)
    eos_text = tokenizer.special_token("eos_token")
    eos_id = tokenizer.backend.token_to_id(eos_text) if eos_text else None
    return set() if eos_id is None else {eos_id}


def check_fits(tokenizer: Tokenizer, model_vocab_size: int, folder: Path) -> None:
    """Refuse, with one error line, a tokenizer that cannot work with a model of `model_vocab_size`
    tokens: a token id would fall outside the model's embedding, or an answer would never end (no
    end-of-sequence token)."""
    if tokenizer.vocab_size > model_vocab_size:
        raise UserError(f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model_vocab_size}: they are not made for each other")
    if not tokenizer.eos_ids:
        raise UserError(f"{folder}: no end-of-sequence token: set eos_token_id in generation_config.json or "
                        "config.json, or eos_token in tokenizer_config.json to a token of the vocabulary")


def render_chat_template(template: str, messages: list[dict], special_tokens: dict) -> str:
    from jinja2 import TemplateError

    try:
        return compiled_chat_template(template).render(messages=messages, add_generation_prompt=True,
                                                       **special_tokens)
    except TemplateError as err:  # (its syntax errors too)
        raise UserError(f"the checkpoint's chat template failed: {err}") from None


@functools.cache
def compiled_chat_template(template: str):
    """The template compiled once: compiling takes ~10 ms, rendering a fraction of one (preparing APAR's
    training prompts renders it 7,600 times)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda obj, indent=None, **_: json.dumps(obj, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class HFTokenizersBackend:
    default_add_bos = False  # tokenizer.json's own post-processor decides; we add nothing ourselves

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.tok = RustTokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception on malformed files
            raise UserError(f"cannot read {path}: {err}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)


class SentencePieceBackend:
    default_add_bos = True  # Llama's SentencePiece tokenizers add <s> unless told otherwise

    def __init__(self, path: Path, config: dict):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as err:
            raise UserError(f"cannot read {path}: {err}") from None
        self.vocab_size = self.sp.GetPieceSize()
        # special tokens that may appear literally in a rendered chat template, e.g. "<s>", "</s>"
        self.specials = {self.sp.IdToPiece(i): i for i in range(self.vocab_size)
                         if self.sp.IsControl(i) or self.sp.IsUnknown(i)}
        for id_text, entry in config.get("added_tokens_decoder", {}).items():
            self.specials[entry["content"]] = int(id_text)
        pattern = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True) if s)
        self.special_pattern = re.compile(f"({pattern})") if pattern else None

    def encode(self, text: str, add_bos: bool) -> list[int]:
        ids = [self.sp.bos_id()] if add_bos and self.sp.bos_id() >= 0 else []
        pieces = self.special_pattern.split(text) if self.special_pattern else [text]
        for piece in pieces:
            if piece in self.specials:
                ids.append(self.specials[piece])
            elif piece:
                ids.extend(self.sp.EncodeAsIds(piece))
        return ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        special_ids = set(self.specials.values())
        if skip_special:
            return self.sp.DecodeIds([i for i in ids if i not in special_ids])
        # SentencePiece drops control tokens when decoding; spell them out between the plain runs
        parts, run = [], []
        for i in ids:
            if i in special_ids:
                parts += [self.sp.DecodeIds(run), self.sp.IdToPiece(i)]
                run = []
            else:
                run.append(i)
        return "".join(parts + [self.sp.DecodeIds(run)])

    def id_to_token(self, i: int) -> str:
        return self.sp.IdToPiece(i)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.PieceToId(token)
        return None if self.sp.IsUnknown(i) and token != self.sp.IdToPiece(i) else i


class StreamDecoder:
    """Turns a growing list of token ids into printable text pieces.

    Decoding one token at a time breaks multi-byte characters (byte-level BPE) and drops
    SentencePiece's leading spaces, so each step decodes a short window that starts one chunk back
    and emits only the text that is new; an incomplete character ("\\ufffd") is held back.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.window_start = 0  # the window decoded for context
        self.emitted_up_to = 0  # tokens whose text has been returned

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._new_text(final=False)

    def flush(self) -> str:
        return self._new_text(final=True)

    def _new_text(self, final: bool) -> str:
        seen = self.tokenizer.decode(self.ids[self.window_start:self.emitted_up_to])
        everything = self.tokenizer.decode(self.ids[self.window_start:])
        if len(everything) <= len(seen) or (everything.endswith("\ufffd") and not final):
            return ""
        self.window_start, self.emitted_up_to = self.emitted_up_to, len(self.ids)
        return everything[len(seen):]
