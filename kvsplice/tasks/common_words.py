"""Common-words extraction (RULER's ``cwe``): a numbered list of words in which ``n_common`` words appear many times
and the rest a few times each; the answer names the ``n_common`` most frequent. An aggregation task: no single
token holds the answer, every occurrence counts. The list fills the whole context; the word pool is
:data:`~kvsplice.tasks.vocab.NOUNS` + :data:`~kvsplice.tasks.vocab.ADJECTIVES` (and the words of the stories file
when one is given, for longer contexts)."""

from __future__ import annotations

import random
import re
from typing import Optional

from kvsplice.tasks.haystack import load_stories, n_tokens
from kvsplice.tasks.instance import TaskInstance
from kvsplice.tasks.vocab import ADJECTIVES, NOUNS

__all__ = ["common_words"]


def _pool(stories: Optional[str]) -> list[str]:
    words = set(NOUNS) | set(ADJECTIVES)
    if stories is not None:
        for p in load_stories(str(stories))[:2000]:
            words.update(w for w in re.findall(r"\b[a-z]{4,9}\b", p))
    return sorted(words)


def common_words(tokenizer, length: int, seed: int, rng: random.Random, *, task: str, n_common: int = 10,
                 rare_freq: int = 2, common_share: float = 0.5, stories: Optional[str] = None, **_) -> TaskInstance:
    q = (f"\n\nQuestion: What are the {n_common} most common words in the above list? Answer: The top {n_common} "
         f"words that appear most often in the list are:")
    head = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n")
    budget = length - len(tokenizer.encode(q)) - len(tokenizer.encode(head)) - (1 if tokenizer.sep == "bos" else 0)
    pool = _pool(stories)
    rng.shuffle(pool)
    common, rare = pool[:n_common], pool[n_common:]
    per_entry = n_tokens(tokenizer, f"100. {common[0]}")  # a numbered entry, roughly
    entries = max(2 * n_common, budget // max(per_entry, 1))
    for _ in range(8):  # shrink the list until it fits the budget (no cut: the frequencies stay as drawn)
        freq = max(rare_freq + 2, round(common_share * entries / n_common))  # each common word; rare: rare_freq
        n_rare = min(len(rare), max(0, (entries - freq * n_common) // rare_freq))
        words = common * freq + rare[:n_rare] * rare_freq
        rng.shuffle(words)
        lines = [f"{i}. {w}" for i, w in enumerate(words, 1)]
        used = sum(n_tokens(tokenizer, ln) for ln in lines)
        if used <= budget:
            break
        entries = int(entries * budget / used) - 1
    else:
        raise ValueError(f"common_words: a length of {length} tokens is too short for {n_common} common words")
    kept = [ln.split(". ", 1)[1] for ln in lines]
    counts = {w: kept.count(w) for w in set(kept)}
    top = [w for w in common if counts.get(w, 0) > max((c for v, c in counts.items() if v not in common), default=1)]
    if len(top) < n_common:  # every common word must outnumber every other word
        raise ValueError(f"common_words: a length of {length} tokens is too short for {n_common} common words")
    ctx = head + " ".join(lines)
    top.sort(key=lambda w: -counts[w])
    return TaskInstance(task, length, seed, ctx, q, tuple(top), 4 * n_common + 8,
                        {"common_freq": min(counts[w] for w in top), "entries": len(lines)})
