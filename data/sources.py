"""Reading stories from local TinyStories-style files.

Supported formats (by file extension):

* ``.txt``: stories separated by ``<|endoftext|>`` if the file contains that marker anywhere, else by blank lines
  (one story per blank-line-separated block; a story that itself contains blank lines is then read as several).
* ``.json``: a list of strings, a list of ``{"text": ...}`` objects, or ``{"texts": [...]}`` / ``{"text": [...]}``.
* ``.jsonl``: one JSON string or ``{"text": ...}`` object per line.

A directory means all such files in it (sorted, non-recursive); files whose name contains ``val``/``valid``/
``validation`` as a word (e.g. ``tinystories_val.txt``, ``TinyStories-valid.txt``) form the validation split.

Every listed file is checked with :func:`check_text_file` first: an empty file, or binary/garbage bytes given as text,
is refused with one clear :class:`~data.errors.BadTextError` line instead of being "tokenized" into a few garbage stories.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from data.errors import OFFLINE_HINT, BadTextError, DataUnavailableError

__all__ = ["MAX_BAD_SHARE", "SUFFIXES", "check_text_file", "file_fingerprint", "is_validation_file",
           "iter_stories_from_file", "list_story_files", "text_defects"]

SUFFIXES = (".txt", ".json", ".jsonl")
EOT_MARKER = "<|endoftext|>"
_CHUNK = 1 << 23  # characters read at a time from text files
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_VAL_WORD = re.compile(r"(?:^|[^a-z])(?:val|valid|validation)(?:[^a-z]|$)")


#: Largest share of sampled characters that may be undecodable (not UTF-8) or control characters in a text file.
#: Real text (any language, UTF-8) has none; random bytes have ~50 % undecodable + ~10 % control characters.
MAX_BAD_SHARE = 0.01
_SAMPLE_BYTES = 1 << 16  # bytes read at the start, middle and end of a file by check_text_file
# control characters other than tab, newline, vertical tab, form feed, carriage return; U+FFFD = undecodable bytes
_BAD_CHARS = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")


def _option_name(option: str) -> str:
    return option.lstrip("-") or "data.path"


def text_defects(data: bytes) -> tuple[int, int]:
    """``(characters, bad)`` of ``data`` decoded as UTF-8: ``bad`` counts undecodable bytes (each becomes U+FFFD)
    plus control characters other than tab/newline/vertical tab/form feed/carriage return (NUL, ESC, DEL, C1...)."""
    text = data.decode("utf-8", errors="replace")
    return len(text), len(_BAD_CHARS.findall(text))


def check_text_file(path: str | os.PathLike[str], option: str = "data.path", *,
                    max_bad_share: float = MAX_BAD_SHARE, sample_bytes: int = _SAMPLE_BYTES) -> Path:
    """Refuse a file that cannot be training or calibration text; return it as a ``Path`` when it can.

    Reads at most three samples of ``sample_bytes`` (start, middle, end: cheap for any file size) and decodes them
    as UTF-8. The file is refused when it is empty or whitespace only, or when more than ``max_bad_share`` of the
    sampled characters are undecodable bytes or control characters (binary data, random bytes, UTF-16, a compressed
    or truncated-binary file given as text). Multi-byte characters cut at a sample's edge count as at most a few bad
    characters, far below the threshold.

    Args:
        path: the file.
        option: the option the path came from, for the message (``"data.path"`` or ``"--data.path"``, ``"calib"``);
            messages read ``data.path='x.txt': ...`` and ``--data.path``.
        max_bad_share: the largest allowed share of bad characters (default :data:`MAX_BAD_SHARE`, 1 %).
        sample_bytes: bytes per sample.

    Raises:
        DataUnavailableError: the file does not exist, is not a regular file or cannot be read.
        BadTextError: empty / whitespace-only, or garbage (one line naming ``option``, the share found and the limit).
    """
    name = _option_name(option)
    p = Path(path).expanduser()
    where = f"{name}={str(path)!r}"
    if not p.is_file():
        raise DataUnavailableError(f"{where} does not exist or is not a file: set --{name} to a text file")
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            if size <= 3 * sample_bytes:
                samples = [f.read()]
            else:
                samples = []
                for start in (0, (size - sample_bytes) // 2, size - sample_bytes):
                    f.seek(start)
                    samples.append(f.read(sample_bytes))
    except OSError as e:
        raise DataUnavailableError(f"{where}: cannot read the file ({e.strerror or type(e).__name__})") from None
    if size == 0:
        raise BadTextError(f"{where} is an empty file: give a file with text (stories)")
    if not any(s.strip() for s in samples):
        raise BadTextError(f"{where} holds only whitespace: give a file with text (stories)")
    chars = bad = 0
    for s in samples:
        c, b = text_defects(s)
        chars, bad = chars + c, bad + b
    share = bad / max(1, chars)
    if share > max_bad_share:
        raise BadTextError(
            f"{where} does not look like text: {share:.0%} of the sampled characters are undecodable (not UTF-8) or "
            f"control characters (limit {max_bad_share:.0%}); is it a binary, compressed or non-UTF-8 file? "
            f"Give UTF-8 .txt/.json/.jsonl stories"
        )
    return p


def is_validation_file(path: Path) -> bool:
    """Whether the file's name marks it as validation data (a ``val``, ``valid`` or ``validation`` word)."""
    return _VAL_WORD.search(path.stem.lower()) is not None


def list_story_files(path: str | os.PathLike[str], option: str = "data.path", *, check: bool = True) -> list[Path]:
    """The story files at ``path`` (the file itself, or the supported files in the directory, sorted).

    With ``check`` (default) every file goes through :func:`check_text_file` (empty or garbage files are refused).

    Raises:
        DataUnavailableError: ``path`` does not exist or holds no supported file (the message names ``option``).
        BadTextError: a file is empty or not text (a ``DataUnavailableError`` too).
    """
    option = _option_name(option)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataUnavailableError(
            f"{option}={str(path)!r} does not exist: set --{option} to a TinyStories .txt/.json/.jsonl file or a "
            f"folder of them, {OFFLINE_HINT}"
        )
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise DataUnavailableError(f"{option}={str(path)!r}: unsupported file type (expected one of {SUFFIXES})")
        files = [p]
    else:
        files = sorted(
            f for f in p.iterdir() if f.is_file() and f.suffix.lower() in SUFFIXES and not f.name.startswith(".")
        )
        if not files:
            raise DataUnavailableError(f"{option}={str(path)!r} is a folder without .txt/.json/.jsonl story files")
    if check:
        for f in files:
            check_text_file(f, option)
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


def _jsonl_stories(path: Path) -> Iterator[str]:
    """The stories of a ``.jsonl`` file; a line that is not JSON, or not a story, is one error naming the file and
    its line number (counted from 1, blank lines included)."""
    with open(path, encoding="utf-8", errors="replace") as f:  # undecodable bytes: check_text_file bounds them
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise DataUnavailableError(f"{path}: line {lineno} is not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); "
                                           f"each line must be a JSON string or {{\"text\": ...}} object") from None
            try:
                texts = _texts_from_json([obj], path)
            except DataUnavailableError:
                raise DataUnavailableError(f"{path}: line {lineno} holds a JSON {type(obj).__name__}, expected a "
                                           f"string or a {{\"text\": ...}} object") from None
            for text in texts:
                if text := text.strip():
                    yield text


def iter_stories_from_file(path: Path) -> Iterator[str]:
    """Yield the (stripped, non-empty) stories of one file; see the module docstring for the formats.

    Raises:
        DataUnavailableError: a ``.json`` file that is not valid JSON or not a list of stories, a ``.jsonl`` line that
            is not (the message names the file and the line).
    """
    suffix = path.suffix.lower()
    if suffix == ".json":
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                obj = json.load(f)
            except json.JSONDecodeError as e:
                raise DataUnavailableError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        for text in _texts_from_json(obj, path):
            if text := text.strip():
                yield text
    elif suffix == ".jsonl":
        yield from _jsonl_stories(path)
    elif _file_contains(path, EOT_MARKER):
        yield from _split_stream(path, EOT_MARKER)
    else:
        yield from _split_stream(path, _BLANK_LINE)
