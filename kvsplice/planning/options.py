"""The options of a planner run (``plan``) as one typed object, built from the command line by
:func:`kvsplice.cli.plan.options` and passed down instead of the parser's namespace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsplice.core.limits import MAX_TOKENS, check_count, check_threads
from kvsplice.io.run_options import RunOptions

__all__ = ["PlanOptions"]

TUNE_TASKS = ("passkey", "niah_number_facts", "niah_number_stories")
"""The accuracy objective's default tasks: a number hidden in filler, in encyclopedic facts and in real prose (the
calibration text's)."""


# The planner's calibration tokens: its low-rank candidates' statistics (Grams of keys, values, queries and their
# loss gradients, at most H·d = a few hundred wide) settle well before 16k tokens, and the pass (forward + backward)
# is most of the planner's time; `kvsplice fit-bases` calibrates a final fit on more (65,536).
PLAN_CALIB_TOKENS = 16384

MAX_TUNE_N = 1000
"""Tuning instances per task at most: every one is built and prefilled up front (the default 4 takes minutes)."""


@dataclass(frozen=True)
class PlanOptions(RunOptions):
    """What ``plan`` searches: the model, the calibration text (``calib_tokens`` for the statistics, then
    ``tune_tokens`` of tuning windows of ``seq_len``, each compressing its first ``prompt_len``), the budget
    (``budget_bytes_per_token`` or ``ratio``: times smaller than the fp16 full cache, > 1) at ``fit_length``, the
    candidates (``selectors``, ``stores``: specs or ``"default"``), the pick (``objective`` on ``tune_tasks`` ×
    ``tune_n`` at ``tune_length``, ``task_tolerance``, ``prefill``) and the outputs."""

    model: str
    calib: str
    out: str
    tokenizer: Optional[str] = None
    budget_bytes_per_token: Optional[float] = None
    ratio: Optional[float] = None
    calib_tokens: int = PLAN_CALIB_TOKENS
    calib_stats: Optional[str] = None
    tune_tokens: int = 2048
    seq_len: int = 1024
    prompt_len: Optional[int] = None
    selectors: tuple[str, ...] = ()
    stores: Optional[tuple[str, ...]] = None
    batch_size: int = 2
    objective: str = "mixed"
    tune_tasks: tuple[str, ...] = TUNE_TASKS
    tune_n: int = 4
    tune_length: Optional[int] = None
    fit_length: Optional[int] = None
    tune_setting: str = "agnostic"
    task_tolerance: float = 0.0
    prefill: str = "fast"
    stories: Optional[str] = None
    json: Optional[str] = None

    def __post_init__(self) -> None:
        """Every count within its bound before anything is read or allocated (one line naming the option)."""
        for option, value in (("--calib-tokens", self.calib_tokens), ("--tune-tokens", self.tune_tokens),
                              ("--seq-len", self.seq_len), ("--batch-size", self.batch_size)):
            check_count(option, value, 1, MAX_TOKENS)
        check_count("--tune-n", self.tune_n, 1, MAX_TUNE_N, "tuning instances are built up front")
        for option, value in (("--prompt-len", self.prompt_len), ("--tune-length", self.tune_length),
                              ("--fit-length", self.fit_length)):
            if value is not None:
                check_count(option, value, 1, MAX_TOKENS)
        check_threads("--threads", self.threads)

    @property
    def window_prompt(self) -> int:
        """The compressed prompt of a tuning window (default 3/4 of it)."""
        return self.prompt_len or (3 * self.seq_len) // 4
