"""The options of a planner run (``plan``) as one typed object: the declaration of the command line too (each
field's flag, help and parser: :mod:`kvsplice.io.options`), and the defaults of the library's search
(:class:`kvsplice.planning.search.SearchOptions` takes them from here)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Optional

from kvsplice.core.amounts import check_times_smaller, times_smaller
from kvsplice.core.limits import MAX_TOKENS, check_count, check_number, check_threads
from kvsplice.io.cli import pos_int
from kvsplice.io.options import Exclusive, opt
from kvsplice.io.run_options import RunOptions
from kvsplice.planning.candidates import DEFAULT_SELECTORS

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


def _pos_float(s: str) -> float:
    """argparse type: a finite number > 0 (``inf`` / ``nan`` are refused here, before any work)."""
    try:
        return check_number("", float(s))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {s}") from None


def _nonneg_float(s: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        return check_number("", float(s), 0.0, lo_open=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite, got {s}") from None


def _selector(s: str) -> str:
    """argparse type: a selector the planner can build (``snapkv``, ``kvzip(mix=observed_attention,share=0.5)``)."""
    from kvsplice.planning.candidates import check_selector

    try:
        return check_selector(s)
    except (ValueError, TypeError) as e:  # incl. an argument that does nothing (reach= without recon=local)
        raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None


def _store(s: str) -> str:
    """argparse type: a storage method's spec (``int8``, ``kivi(bits=2)``, a .json file) or ``default``, its names
    and values checked here (:func:`kvsplice.planning.candidates.store_specs`)."""
    from kvsplice.planning.candidates import store_specs

    try:
        store_specs([s])
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).splitlines()[0].removeprefix("--stores ")) from None
    return s


def _selectors_help() -> str:
    from kvsplice.core.registry import select_names

    return (f"token selectors to try, NAME[(KEY=VALUE,...)] (default {' '.join(DEFAULT_SELECTORS)}; known: "
            f"{', '.join(select_names())}; kvzip re-reads the prompt)")


@dataclass(frozen=True)
class PlanOptions(RunOptions):
    """What ``plan`` searches: the model, the calibration text (``calib_tokens`` for the statistics, then
    ``tune_tokens`` of tuning windows of ``seq_len``, each compressing its first ``prompt_len``), the budget
    (``budget_bytes_per_token`` or ``ratio``: times smaller than the fp16 full cache, > 1) at ``fit_length``, the
    candidates (``selectors``, ``stores``: specs or ``"default"``), the pick (``objective`` on ``tune_tasks`` ×
    ``tune_n`` at ``tune_length``, ``task_tolerance``, ``prefill``) and the outputs. The fields declare the command
    line (in this order in ``--help``)."""

    OPTION_GROUPS: ClassVar = (Exclusive(("budget_bytes_per_token", "ratio"), required=True),)

    model: str = opt(help="model directory, .gguf file, training .ckpt or Hub id")
    tokenizer: Optional[str] = opt(None, help="override the model's tokenizer")
    calib: str = opt(help="calibration text (.txt/.json/.jsonl, folder, or dataset id)")
    budget_bytes_per_token: Optional[float] = opt(None, parse=_pos_float, help="cache bytes per prompt token (fp16 "
                                                  "storage)")
    ratio: Optional[float] = opt(None, parse=times_smaller, help="times smaller than the fp16 full K/V cache (> 1)")
    calib_tokens: int = opt(PLAN_CALIB_TOKENS, parse=pos_int, help=f"calibration tokens (default "
                            f"{PLAN_CALIB_TOKENS}); the tuning windows follow them")
    calib_stats: Optional[str] = opt(None, help="calibration statistics of the low-rank stores: reused when the file "
                                     "exists, written otherwise — when --stores has a low-rank store (the default "
                                     "list has); with none nothing is calibrated and the file is neither read nor "
                                     "written (a note says so)")
    tune_tokens: int = opt(2048, parse=pos_int, help="tuning tokens after the calibration tokens (default 2048)")
    seq_len: Optional[int] = opt(None, parse=pos_int, help="calibration and tuning window (default: the model's "
                                 "positions, at most 1024)")
    prompt_len: Optional[int] = opt(None, parse=pos_int, help="compressed prompt per tuning window (default 3/4 of "
                                    "it)")
    selectors: tuple[str, ...] = opt(DEFAULT_SELECTORS, parse=_selector, metavar="SELECTOR", help=_selectors_help())
    stores: Optional[tuple[str, ...]] = opt(None, parse=_store, metavar="SPEC", help="candidate storage methods as "
                                            "method specs (e.g. int8 kivi4 mine(x=1); 'default' = the built-in list: "
                                            "full K/V fp16/int8, int8 keys + int4 values (k8v4h), KIVI 4/2-bit, "
                                            "fisher low rank at 1.5/2/3x, int8 coefficients); default: default")
    batch_size: int = opt(2, parse=pos_int, help="windows per forward (default 2)")
    objective: str = opt("mixed", choices=("ppl", "tasks", "mixed"), help="what the stack must keep: mixed "
                         "(default): the best tuning perplexity among the candidates with the best accuracy on "
                         "tuning task instances (seeds >= 1,000,000, never reported); tasks: that accuracy (ties: "
                         "perplexity); ppl: tuning perplexity alone (it may trade retrieval away)")
    tune_tasks: tuple[str, ...] = opt(TUNE_TASKS, metavar="TASK", help=f"tasks of the accuracy objective (default "
                                      f"{' '.join(TUNE_TASKS)}: a needle in each kind of haystack — filler, facts, "
                                      f"real prose; see eval-tasks)")
    tune_n: int = opt(4, parse=pos_int, help=f"tuning instances per task (default 4, at most {MAX_TUNE_N})")
    tune_length: Optional[int] = opt(None, parse=pos_int, help="tuning instances' prompt tokens (default --seq-len, "
                                     "at least 64, raised to hold every tuning task's prompt; a given one must hold "
                                     "them and fit the model's positions, as eval-tasks --lengths must)")
    fit_length: Optional[int] = opt(None, parse=pos_int, help="the prompt tokens at which the budget holds (default "
                                    "--prompt-len; at most the model's positions): a store with a fixed-size part, "
                                    "KIVI's full-precision window, fits more tokens on a longer prompt; give the "
                                    "length the plan is for, e.g. the --tune-length")
    prefill: str = opt("fast", choices=("fast", "any"), help="fast (default): with tuning tasks, pick among the "
                       "fast-prefill selectors (KVzip recon=local, snapkv, ObservedAttention stride>=8: prefill + "
                       "compression about one prefill) when one holds the tuning tasks, trying the others only when "
                       "none does; any: among all selectors, by the objective alone")
    tune_setting: str = opt("agnostic", choices=("agnostic", "aware"), help="the question after the compressed "
                            "context (default) or inside it")
    task_tolerance: float = opt(0.0, parse=_nonneg_float, help="mixed: accuracy points below the best a candidate "
                                "may lose (default 0)")
    stories: Optional[str] = opt(None, help="prose for --tune-tasks that hide a needle in stories (default: the "
                                 "--calib text when it is a local file)")
    out: str = opt(help="the plan (.json); low-rank bases go beside it")
    json: Optional[str] = opt(None, help="also write the search report here")

    def __post_init__(self) -> None:
        """Every count within its bound before anything is read or allocated (one line naming the option)."""
        for option, value in (("--calib-tokens", self.calib_tokens), ("--tune-tokens", self.tune_tokens),
                              ("--batch-size", self.batch_size)):
            check_count(option, value, 1, MAX_TOKENS)
        check_count("--tune-n", self.tune_n, 1, MAX_TUNE_N, "tuning instances are built up front")
        for option, value in (("--seq-len", self.seq_len), ("--prompt-len", self.prompt_len),
                              ("--tune-length", self.tune_length), ("--fit-length", self.fit_length)):
            if value is not None:
                check_count(option, value, 1, MAX_TOKENS)
        check_threads("--threads", self.threads)
        if self.ratio is not None:
            check_times_smaller("--ratio", self.ratio)
        if self.budget_bytes_per_token is not None:
            check_number("--budget-bytes-per-token", self.budget_bytes_per_token)
        if (self.ratio is None) == (self.budget_bytes_per_token is None):
            raise ValueError("give one of --budget-bytes-per-token and --ratio")

    def window(self, max_positions: Optional[int]) -> int:
        """The calibration and tuning window: ``seq_len``, else the model's positions, at most 1024."""
        from kvsplice.io.cli import default_seq_len

        return self.seq_len or default_seq_len(max_positions)

    def window_prompt(self, seq: int) -> int:
        """The compressed prompt of a tuning window of ``seq`` tokens (default 3/4 of it)."""
        return self.prompt_len or (3 * seq) // 4
