"""Haystacks: the text a needle hides in, sized in the model's own tokens.

Three kinds (:data:`HAYSTACKS`):

* ``filler`` — RULER's repeated line ("The grass is green. The sky is blue. ..."), as the passkey test uses;
* ``stories`` — real prose: paragraphs of TinyStories from a local file (``stories=``), read from a seeded offset;
* ``facts`` — a second domain that is not stories: encyclopedic sentences about invented places, materials and
  people, with numbers and years in them (:func:`kvsplice.tasks.vocab.fact_sentence`).

:func:`build_context` joins haystack pieces until the next would pass the token budget and inserts the given
sentences (needles) at their depths (0 = first, 1 = last), between pieces. Token counts come from the tokenizer
itself (each piece encoded with its leading space, as it sits in the joined text), so a context is within a few
tokens of its budget; the instance records the exact count of the ids it feeds.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from kvsplice.tasks.vocab import FILLER, fact_sentence

__all__ = ["HAYSTACKS", "build_context", "check_stories", "haystack_pieces", "load_stories", "n_tokens"]

HAYSTACKS = ("filler", "stories", "facts")


def check_stories(path: str, option: str = "--stories") -> Path:
    """``path`` is a local text file the stories haystacks can read: it exists and is UTF-8 text, not binary or
    empty (the check every command's text reader makes: :func:`data.sources.list_story_files`); a ``ValueError``
    naming ``option`` otherwise. Returns the path."""
    from data.errors import DataUnavailableError
    from data.sources import list_story_files

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{option} file not found: {path} (give a TinyStories .txt/.json/.jsonl file)")
    try:
        list_story_files(p, option=option.lstrip("-"))
    except DataUnavailableError as e:
        raise ValueError(" ".join(str(e).split("\n")[0].split())) from None
    return p


@functools.lru_cache(maxsize=4)
def load_stories(path: str) -> tuple[str, ...]:
    """The paragraphs of a local TinyStories file (``.txt`` / ``.json`` / ``.jsonl``; checked to be text:
    :func:`check_stories`), cached per path."""
    from data.sources import iter_stories_from_file

    p = check_stories(path, "stories")
    stories = tuple(s.strip() for s in iter_stories_from_file(p) if s.strip())
    if not stories:
        raise ValueError(f"{path} holds no text")
    return stories


def haystack_pieces(kind: str, rng: random.Random, stories: Optional[str] = None,
                    keep: Callable[[str], bool] = lambda s: True) -> Iterator[str]:
    """An endless stream of haystack pieces of ``kind`` (stories: paragraphs from a random offset, cycling, those
    for which ``keep`` is true)."""
    if kind == "filler":
        while True:
            yield FILLER
    elif kind == "facts":
        while True:
            yield fact_sentence(rng)
    elif kind == "stories":
        if stories is None:
            raise ValueError("the stories haystack needs a TinyStories file (stories=PATH / --stories)")
        paras = load_stories(str(stories))
        i = rng.randrange(len(paras))
        for j in range(len(paras)):
            p = paras[(i + j) % len(paras)]
            if keep(p):
                yield p
        raise ValueError(f"{stories}: not enough text for the haystack")
    else:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {kind!r}")


def n_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` with a leading space, as a piece inside the joined context."""
    return len(tokenizer.encode(" " + text))


def build_context(tokenizer, pieces: Iterator[str], budget: int,
                  inserts: Sequence[tuple[float, str]] = (), head: str = "") -> str:
    """``head`` (the task's instruction) + haystack ``pieces`` joined until ``budget`` tokens (head and inserts
    included) would be passed, with each ``(depth, sentence)`` of ``inserts`` placed between pieces at
    ``round(depth · n_pieces)`` (equal depths keep their order)."""
    room = budget - sum(n_tokens(tokenizer, s) for _, s in inserts) - (len(tokenizer.encode(head)) if head else 0)
    body: list[str] = []
    used = 0
    for p in pieces:
        c = n_tokens(tokenizer, p)
        if used + c > room:
            break
        body.append(p)
        used += c
    while True:  # the joined text measured exactly: drop the last piece while it is over (a boundary token)
        text = _assemble(body, inserts, head)
        if len(tokenizer.encode(text)) <= budget or not body:
            return text
        body.pop()


def _assemble(body: list[str], inserts: Sequence[tuple[float, str]], head: str) -> str:
    slots: dict[int, list[str]] = {}
    for depth, s in inserts:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
        slots.setdefault(round(depth * len(body)), []).append(s)
    out: list[str] = []
    for i in range(len(body) + 1):
        out.extend(slots.get(i, ()))
        if i < len(body):
            out.append(body[i])
    return head + " ".join(out)
