"""JSON Lines files: one record per "\n"-terminated line.

str.splitlines() also breaks at U+2028, U+2029, U+0085 and other separators that json.dumps(ensure_ascii=False)
leaves inside strings, so a model answer containing one would be torn into two invalid lines.
"""

from collections.abc import Iterator
from pathlib import Path


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for every non-blank line."""
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), start=1):
        if line.strip():
            yield number, line
