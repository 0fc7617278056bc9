"""Needle-in-a-haystack tasks (RULER's NIAH family and the passkey test), generated from a seed.

* :func:`passkey` — a 5-digit pass key in the repeated filler: "The pass key is NNNNN. Remember it. NNNNN is the pass
  key." → "What is the pass key? The pass key is".
* :func:`single` — one key → value needle (``value``: number / word / uuid) in any haystack.
* :func:`multikey` — the asked needle among distractor needles with other keys.
* :func:`multivalue` — one key with several values; all must be recalled.
* :func:`multiquery` — several keys asked at once; every value must be recalled.

Depths are drawn uniformly from the seed, so instances spread over the context. ``length`` is the whole prompt in
the model's tokens (context + question, BOS included).
"""

from __future__ import annotations

import random
from typing import Optional

from kvsplice.tasks.haystack import build_context, haystack_pieces
from kvsplice.tasks.instance import TaskInstance
from kvsplice.tasks.vocab import random_key, random_value

__all__ = ["multikey", "multiquery", "multivalue", "passkey", "single"]

_NOUN = {"number": "number", "word": "word", "uuid": "uuid"}
_NEW = {"number": 12, "word": 8, "uuid": 32}  # tokens to generate per value


PASSKEY_HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will "
                "quiz you about the important information there.\n\n")


def _head(kind: str) -> str:
    """RULER's instruction before a needle haystack."""
    return (f"Some special magic {_NOUN[kind]}s are hidden within the following text. Make sure to memorize them. "
            f"I will quiz you about the {_NOUN[kind]}s afterwards.\n\n")


def _needle(key: str, kind: str, value: str) -> str:
    return f"One of the special magic {_NOUN[kind]}s for {key} is: {value}."


def _ask(keys: list[str], kind: str, many: bool) -> str:
    noun = _NOUN[kind] + ("s" if many else "")
    what = ", ".join(keys[:-1]) + (" and " if len(keys) > 1 else "") + keys[-1]
    verb = "are" if many else "is"
    return (f"\n\nWhat {verb} the special magic {noun} for {what} mentioned in the provided text? "
            f"The special magic {noun} for {what} mentioned in the provided text {verb}")


def _keys_values(rng: random.Random, n: int, value: str) -> tuple[list[str], list[str]]:
    """``n`` distinct keys and ``n`` distinct values."""
    keys: list[str] = []
    vals: list[str] = []
    for _ in range(n):
        keys.append(random_key(rng, set(keys)))
        vals.append(random_value(value, rng, set(vals)))
    return keys, vals


def _budget(tokenizer, length: int, question: str) -> int:
    return length - len(tokenizer.encode(question)) - (1 if tokenizer.sep == "bos" else 0)


def passkey(tokenizer, length: int, seed: int, rng: random.Random, **_) -> TaskInstance:
    v = str(rng.randint(10_000, 99_999))
    depth = rng.random()
    q = "\n\nWhat is the pass key? The pass key is"
    ctx = build_context(tokenizer, haystack_pieces("filler", rng), _budget(tokenizer, length, q),
                        [(depth, f"The pass key is {v}. Remember it. {v} is the pass key.")], PASSKEY_HEAD)
    return TaskInstance("passkey", length, seed, ctx, q, (v,), 8, {"depth": depth, "haystack": "filler"})


def single(tokenizer, length: int, seed: int, rng: random.Random, *, task: str, value: str = "number",
           haystack: str = "filler", stories: Optional[str] = None, **_) -> TaskInstance:
    key, v, depth = random_key(rng), random_value(value, rng), rng.random()
    q = _ask([key], value, False)
    ctx = build_context(tokenizer, haystack_pieces(haystack, rng, stories), _budget(tokenizer, length, q),
                        [(depth, _needle(key, value, v))], _head(value))
    return TaskInstance(task, length, seed, ctx, q, (v,), _NEW[value], {"depth": depth, "haystack": haystack})


def multikey(tokenizer, length: int, seed: int, rng: random.Random, *, task: str, n_keys: int = 4,
             value: str = "number", haystack: str = "filler", stories: Optional[str] = None, **_) -> TaskInstance:
    keys, vals = _keys_values(rng, n_keys, value)
    depths = [rng.random() for _ in keys]
    q = _ask([keys[0]], value, False)
    ctx = build_context(tokenizer, haystack_pieces(haystack, rng, stories), _budget(tokenizer, length, q),
                        sorted(zip(depths, (_needle(k, value, v) for k, v in zip(keys, vals)))), _head(value))
    return TaskInstance(task, length, seed, ctx, q, (vals[0],), _NEW[value],
                        {"depth": depths[0], "distractor_depths": depths[1:], "haystack": haystack})


def multivalue(tokenizer, length: int, seed: int, rng: random.Random, *, task: str, n_values: int = 4,
               value: str = "number", haystack: str = "filler", stories: Optional[str] = None, **_) -> TaskInstance:
    key = random_key(rng)
    vals: list[str] = []
    for _ in range(n_values):
        vals.append(random_value(value, rng, set(vals)))
    depths = sorted(rng.random() for _ in vals)
    q = _ask([key], value, True)
    ctx = build_context(tokenizer, haystack_pieces(haystack, rng, stories), _budget(tokenizer, length, q),
                        [(d, _needle(key, value, v)) for d, v in zip(depths, vals)], _head(value))
    return TaskInstance(task, length, seed, ctx, q, tuple(vals), _NEW[value] * n_values,
                        {"depths": depths, "haystack": haystack})


def multiquery(tokenizer, length: int, seed: int, rng: random.Random, *, task: str, n_queries: int = 4,
               value: str = "number", haystack: str = "filler", stories: Optional[str] = None, **_) -> TaskInstance:
    keys, vals = _keys_values(rng, n_queries, value)
    depths = [rng.random() for _ in keys]
    q = _ask(keys, value, True)
    ctx = build_context(tokenizer, haystack_pieces(haystack, rng, stories), _budget(tokenizer, length, q),
                        sorted(zip(depths, (_needle(k, value, v) for k, v in zip(keys, vals)))), _head(value))
    return TaskInstance(task, length, seed, ctx, q, tuple(vals), _NEW[value] * n_queries,
                        {"depths": depths, "haystack": haystack})
