"""One task instance — a context, a question, the expected strings — and its exact-match score.

The prompt's token ids are ``[bos] + encode(context) + encode(question)`` (context and question tokenised apart, so
both settings feed identical ids): query-**aware** compresses them all and generates; query-**agnostic** compresses
``[bos] + context`` and then feeds the question over the compressed cache (kvpress's protocol; a cache that serves
several questions must pass it). A generated answer scores the fraction of the expected strings it contains (RULER's
``string_match_all``: case-insensitive, each string bounded by non-alphanumerics); 1.0 is an exact match.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

__all__ = ["SETTINGS", "TaskInstance", "match_score", "prompt_ids", "settled"]

SETTINGS = ("agnostic", "aware")


@dataclass(frozen=True)
class TaskInstance:
    """``task`` at target ``length`` (prompt tokens) drawn from ``seed``: ``context`` + ``question`` → ``answers``."""

    task: str
    length: int
    seed: int
    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int
    meta: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """A stable identity: ``task/length/seed``."""
        return f"{self.task}/{self.length}/{self.seed}"

    def score(self, output: str) -> float:
        return match_score(output, self.answers)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "answers": list(self.answers)}


def match_score(output: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` found in ``output`` (case-insensitive, not inside a longer word or number)."""
    if not answers:
        raise ValueError("an instance needs at least one expected answer")
    text = output.lower()
    found = sum(bool(re.search(rf"(?<![0-9a-z]){re.escape(a.lower())}(?![0-9a-z])", text)) for a in answers)
    return found / len(answers)


def settled(output: str, answers: Sequence[str]) -> bool:
    """Whether more generated text can no longer change ``output``'s score: every answer is found and followed by a
    character that ends it (text is only appended, so each match stays bounded). A run that only needs the score may
    stop there (the planner's tuning instances); the recorded answers of a reported run are never cut."""
    text = output.lower()
    return all(re.search(rf"(?<![0-9a-z]){re.escape(a.lower())}[^0-9a-z]", text) for a in answers)


def prompt_ids(tokenizer, inst: TaskInstance) -> tuple[list[int], list[int]]:
    """``(context ids with the tokenizer's BOS when it uses one, question ids)``."""
    bos = [tokenizer.bos_id] if tokenizer.sep == "bos" and tokenizer.bos_id is not None else []
    return bos + tokenizer.encode(inst.context), tokenizer.encode(inst.question)
