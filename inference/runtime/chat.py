"""Prompts in, text out: chat templates, prompt files and glitch-free streaming text."""

import json
from pathlib import Path

from inference.runtime.errors import UserError
from inference.runtime.jsonl import jsonl_lines
from openpangu_model import NO_THINK_SUFFIX, split_thinking

PANGU_THINK_MARKERS = {"[unused16]": "<think>\n", "[unused17]": "\n</think>\n", "[unused10]": ""}


def prompt_ids(tokenizer, messages: list[dict], no_think: bool = False) -> list[int]:
    """Token ids of a chat rendered with the model's template, ready for the assistant's reply.

    The template is rendered to text and then tokenized with the tokenizer's own special-token rule,
    so OpenPangu gets its BOS and models whose templates carry their own markers get none added.
    """
    if no_think and messages and messages[-1]["role"] == "user":
        messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + NO_THINK_SUFFIX}]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def read_prompts(path: str) -> list[dict]:
    """A jsonl file: objects with `prompt` (one turn) or `turns` (MT-Bench style, several user turns).

    Returns dicts with `turns` (list of str) plus whatever else the line carried (id, category...).
    """
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prompt file {path} does not exist")
    items = []
    for number, line in jsonl_lines(file):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number} is not valid JSON: {error}") from None
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            turns = [record["prompt"]]
        elif isinstance(record, dict) and isinstance(record.get("turns"), list) and record["turns"]:
            turns = record["turns"]
        else:
            raise UserError(f"{path}:{number} needs a 'prompt' string or a non-empty 'turns' list")
        if not all(isinstance(turn, str) and turn.strip() for turn in turns):
            raise UserError(f"{path}:{number}: every prompt and turn must be a non-empty string")
        items.append({**{k: v for k, v in record.items() if k not in ("prompt", "turns")}, "turns": turns})
    if not items:
        raise UserError(f"prompt file {path} holds no prompts")
    return items


class IncrementalText:
    """Streams decoded text without glitches.

    SentencePiece and byte-level BPE pieces only decode correctly in context (a leading space belongs
    to the word after it, a UTF-8 character may span tokens), so each delta is the difference between
    decoding a short window of tokens with and without the new ones, never a chunk decoded alone.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]


def display_text(tokenizer, token_ids: list[int], pangu: bool) -> tuple[str | None, str]:
    """(thinking, answer) for OpenPangu, whose special tokens are kept until they are split; else (None, text)."""
    if pangu:
        return split_thinking(tokenizer.decode(token_ids, skip_special_tokens=False))
    return None, tokenizer.decode(token_ids, skip_special_tokens=True).strip()


def stream_filter(delta: str, pangu: bool) -> str:
    """Readable streaming for OpenPangu: thinking markers become <think> tags, EOS disappears."""
    if pangu:
        for marker, shown in PANGU_THINK_MARKERS.items():
            delta = delta.replace(marker, shown)
    return delta
