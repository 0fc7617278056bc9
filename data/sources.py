"""Reading stories from local TinyStories-style files.

Supported formats (by file extension):

* ``.txt``: stories separated by ``<|endoftext|>`` if the file contains that marker anywhere, else by blank lines
  (one story per blank-line-separated block; a story that itself contains blank lines is then read as several).
* ``.json``: a list of strings, a list of ``{"text": ...}`` objects, or ``{"texts": [...]}`` / ``{"text": [...]}``.
* ``.jsonl``: one JSON string or ``{"text": ...}`` object per line.

A directory means all such files in it (sorted, non-recursive); files whose name contains ``val``/``valid``/
``validation`` as a word (e.g. ``tinystories_val.txt``, ``TinyStories-valid.txt``) form the validation split.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from data.errors import OFFLINE_HINT, DataUnavailableError

__all__ = ["SUFFIXES", "file_fingerprint", "is_validation_file", "iter_stories_from_file", "list_story_files"]

SUFFIXES = (".txt", ".json", ".jsonl")
EOT_MARKER = "<|endoftext|>"
_CHUNK = 1 << 23  # characters read at a time from text files
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_VAL_WORD = re.compile(r"(?:^|[^a-z])(?:val|valid|validation)(?:[^a-z]|$)")


def is_validation_file(path: Path) -> bool:
    """Whether the file's name marks it as validation data (a ``val``, ``valid`` or ``validation`` word)."""
    return _VAL_WORD.search(path.stem.lower()) is not None


def list_story_files(path: str | os.PathLike[str], option: str = "data.path") -> list[Path]:
    """The story files at ``path`` (the file itself, or the supported files in the directory, sorted).

    Raises:
        DataUnavailableError: ``path`` does not exist or holds no supported file (the message names ``option``).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataUnavailableError(
            f"{option}={str(path)!r} does not exist: set --{option} to a TinyStories .txt/.json/.jsonl file or a "
            f"folder of them, {OFFLINE_HINT}"
        )
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise DataUnavailableError(f"{option}={str(path)!r}: unsupported file type (expected one of {SUFFIXES})")
        return [p]
    files = sorted(
        f for f in p.iterdir() if f.is_file() and f.suffix.lower() in SUFFIXES and not f.name.startswith(".")
    )
    if not files:
        raise DataUnavailableError(f"{option}={str(path)!r} is a folder without .txt/.json/.jsonl story files")
    return files


def file_fingerprint(path: Path) -> dict[str, object]:
    """Identity of a file for cache keys: resolved path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _file_contains(path: Path, needle: str) -> bool:
    """Whether the text file contains ``needle`` (streamed; needles spanning chunk borders are found)."""
    keep = len(needle) - 1
    tail = ""
    with open(path, encoding="utf-8", errors="replace") as f:
        while chunk := f.read(_CHUNK):
            if needle in tail + chunk:
                return True
            tail = chunk[-keep:] if keep else ""
    return False


def _split_stream(path: Path, sep: re.Pattern[str] | str) -> Iterator[str]:
    """Stream the file's separator-delimited pieces, stripped, skipping empty ones."""
    split = sep.split if isinstance(sep, re.Pattern) else (lambda s: s.split(sep))  # type: ignore[union-attr]
    carry = ""
    with open(path, encoding="utf-8", errors="replace") as f:  # universal newlines: \r\n -> \n
        while chunk := f.read(_CHUNK):
            parts = split(carry + chunk)
            carry = parts.pop()
            for part in parts:
                if part := part.strip():
                    yield part
    if carry := carry.strip():
        yield carry


def _texts_from_json(obj: object, path: Path) -> list[str]:
    if isinstance(obj, dict):
        for key in ("texts", "text", "stories", "data"):
            if key in obj:
                return _texts_from_json(obj[key], path)
        raise DataUnavailableError(f"{path}: JSON object without a 'texts' list")
    if isinstance(obj, list):
        out = []
        for item in obj:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, dict) and isinstance(item.get("text", item.get("story")), str):
                out.append(item.get("text", item.get("story")))
            else:
                raise DataUnavailableError(f"{path}: JSON list items must be strings or {{'text': ...}} objects")
        return out
    raise DataUnavailableError(f"{path}: expected a JSON list of stories or {{'texts': [...]}}")


def iter_stories_from_file(path: Path) -> Iterator[str]:
    """Yield the (stripped, non-empty) stories of one file; see the module docstring for the formats."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                obj = json.load(f)
            except json.JSONDecodeError as e:
                raise DataUnavailableError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        for text in _texts_from_json(obj, path):
            if text := text.strip():
                yield text
    elif suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    for text in _texts_from_json([json.loads(line)], path):
                        if text := text.strip():
                            yield text
    elif _file_contains(path, EOT_MARKER):
        yield from _split_stream(path, EOT_MARKER)
    else:
        yield from _split_stream(path, _BLANK_LINE)
