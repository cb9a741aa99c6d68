"""The prompts a program decodes: from --prompt, standard input or a JSONL file (one {"prompt": ...}
per line), each checked to be UTF-8 text that is not empty, and turned into token ids (through the
checkpoint's chat template unless --raw) that leave room for an answer in the model's context. Every
problem names where the prompt came from: "--prompt", "standard input" or FILE:LINE.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from errors import UserError
from decode import room_for_new_tokens


@dataclass(frozen=True)
class Prompt:
    text: str
    where: str  # named in messages: "--prompt", "standard input" or FILE:LINE


def read_prompts(args) -> list[Prompt]:
    if args.prompt is not None:
        return [checked(Prompt(args.prompt, "--prompt"))]
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    if sys.stdin is None:
        raise UserError("give --prompt or --prompt-file (standard input is closed)")
    return [checked(Prompt(utf8(sys.stdin.buffer.read(), "standard input"), "standard input"))]


def utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{where} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                        "save it as UTF-8") from None


def checked(prompt: Prompt) -> Prompt:
    """A prompt with text to decode: not empty, and nothing that is not UTF-8 (a command-line argument
    with such bytes arrives as lone surrogates, which no tokenizer can encode)."""
    try:
        prompt.text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"{prompt.where} is not UTF-8 text (at character {err.start})") from None
    if not prompt.text.strip():
        raise UserError(f"{prompt.where}: the prompt is empty")
    return prompt


def read_prompt_file(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        where = f"{path}:{number}"
        line = utf8(line, where)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f'{where}: expected an object with a string "prompt"')
        prompts.append(checked(Prompt(record["prompt"], where)))
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


def prompt_ids(args, prompt: Prompt, model, tokenizer) -> list[int]:
    """The prompt's token ids, checked to leave room for an answer in the model's context."""
    try:
        ids = tokenizer.prompt_ids(prompt.text, raw=args.raw)
        if not ids:
            raise UserError("the prompt is no tokens at all: the model needs at least one to answer")
        room_for_new_tokens(model, ids, args.max_new_tokens)
    except UserError as err:
        raise UserError(f"{prompt.where}: {err}") from None
    return ids
