"""The options of the measuring commands that print a table (``verify-memory``, ``bench-decode``) as typed objects:
the declaration of their command lines too (each field's flag, help and parser: :mod:`kvsplice.io.options`), and
the library's defaults. :class:`ReportOptions` is the group both share (device, JSON report, table style, seed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from kvsplice.core.limits import MAX_TOKENS, check_count, check_number, check_threads
from kvsplice.io.cli import DTYPE_NAMES
from kvsplice.io.options import Exclusive, opt
from kvsplice.io.run_options import DeviceOption, ForceOption, ProgressOption
from kvsplice.report.decode_timing import DEFAULT_CONFIGS as DECODE_CONFIGS

__all__ = ["BenchDecodeOptions", "DEFAULT_DECODE_STEPS", "MAX_REPEATS", "ReportOptions", "VerifyMemoryOptions"]

DEFAULT_DECODE_STEPS = 8
"""``verify-memory``'s tokens decoded one at a time after the prefill, when the lengths leave room."""

MAX_REPEATS = 100_000
"""``bench-decode``'s timed / warm-up steps and rounds at most (a million steps of a 124M model is days)."""


@dataclass(frozen=True, kw_only=True)
class ReportOptions(ForceOption, ProgressOption, DeviceOption):
    """What a measuring command shares: ``device`` (None: CUDA when available), the ``json`` report (replaced only
    with ``force``), a ``markdown`` table instead of a rich one, the progress bar (the run options' own
    declarations, :mod:`kvsplice.io.run_options`) and the random ``seed``."""

    json: Optional[str] = opt(None, metavar="FILE", help="write the report as JSON")
    markdown: bool = opt(False, help="print a markdown table instead of a rich table")
    seed: int = opt(0, help="random seed of the weights and tokens (default 0)")


REPORT_HELP = {"force": "overwrite an existing --json file"}
"""``--force``'s help in a measuring command (its only output is the report)."""


def _presets_help() -> str:
    from models.config import PRESETS

    return (f"presets ({', '.join(PRESETS)}) or LightningCLI YAML files (a path, or the stem of a file under "
            f"configs/); default: the five 124M presets")


@dataclass(frozen=True)
class VerifyMemoryOptions(ReportOptions):
    """What ``verify-memory`` measures: the variants (``config`` presets or YAML files, or ``ckpt`` checkpoints;
    neither: :data:`kvsplice.report.memory_check.DEFAULT_CONFIGS`) at every length of ``seq_lens`` in ``dtype``
    (and with an int8 cache when ``cache_quant``), ``batch`` sequences, ``decode_steps`` decoded after the prefill
    (None: :meth:`steps`), and the budget of the 'sequences that fit' column. The fields declare the command line,
    in this order."""

    OPTION_GROUPS: ClassVar = (Exclusive(("config", "ckpt")),)

    config: Optional[tuple[str, ...]] = opt(None, metavar="NAME", help=_presets_help())
    ckpt: Optional[tuple[str, ...]] = opt(None, metavar="PATH", help="training checkpoints (python -m training.fit)")
    seq_lens: tuple[int, ...] = opt((256, 512, 1024), metavar="L", help="cache lengths measured, in tokens "
                                    "(default 256 512 1024)")
    dtype: str = opt("fp16", choices=DTYPE_NAMES, help="the model's and the cache's dtype (default fp16)")
    cache_quant: Optional[str] = opt(None, choices=("int8",), help="also measure every variant with an int8 cache "
                                     "(int8 rows + one fp16 scale per row); vs MHA stays MHA's unquantised cache at "
                                     "--dtype")
    batch: int = opt(1, help="sequences per cache (default 1)")
    budget_gb: float = opt(24.0, help="memory budget in GiB (2^30 bytes) for the 'sequences that fit' column "
                           "(default 24)")
    decode_steps: Optional[int] = opt(None, help="tokens decoded one at a time after the prefill (default 8, fewer "
                                      "when the shortest --seq-lens leaves no room; an explicit value must be < it)")

    def __post_init__(self) -> None:
        """Every length, count and number within its bound before a model is built (one line naming the option)."""
        if not self.seq_lens:
            raise ValueError("--seq-lens needs at least one length")
        for n in self.seq_lens:
            check_count("--seq-lens", n)
        check_count("--batch", self.batch)
        check_number("--budget-gb", self.budget_gb, hi=1e6)  # 1 PiB: more memory than any machine the column means
        if self.decode_steps is not None:
            shortest = min(self.seq_lens)
            check_count("--decode-steps", self.decode_steps, 0, shortest - 1,
                        f"the shortest --seq-lens {shortest} less the one token the prefill needs")

    @property
    def lengths(self) -> list[int]:
        """The lengths measured, ascending, each once."""
        return sorted(set(self.seq_lens))

    def steps(self) -> tuple[int, Optional[str]]:
        """The tokens decoded after the prefill: ``decode_steps``, else :data:`DEFAULT_DECODE_STEPS` or fewer when
        the shortest length leaves no room — then with a note saying so (else ``None``)."""
        if self.decode_steps is not None:
            return self.decode_steps, None
        shortest = self.lengths[0]
        steps = min(DEFAULT_DECODE_STEPS, shortest - 1)
        if steps == DEFAULT_DECODE_STEPS:
            return steps, None
        return steps, (f"--decode-steps {steps} (default {DEFAULT_DECODE_STEPS}): the shortest --seq-lens {shortest} "
                       f"leaves room for no more after a one-token prefill")


@dataclass(frozen=True)
class BenchDecodeOptions(ReportOptions):
    """What ``bench-decode`` times: the variants (``config``: NAME[:IMPL][:int8][:sdpa|:kernel][:graph]) at every
    context of ``ctx``, ``batch`` sequences in ``dtype``; ``repeats`` timed steps split over ``rounds`` (each after
    ``warmup`` untimed ones), at most ``max_seconds`` per cell; torch ``threads``; the ``plot`` and the ``profile``.
    The fields declare the command line, in this order."""

    config: tuple[str, ...] = opt(DECODE_CONFIGS, metavar="NAME[:IMPL][:int8][:sdpa|:kernel][:graph]",
                                  help="presets or YAML configs; MLA ones may end in :naive or :absorb; :int8 for an "
                                  "int8 cache, :sdpa / :kernel for SDPA / the split-KV kernel, :graph for CUDA-graph "
                                  "steps")
    ctx: tuple[int, ...] = opt((512, 2048, 8192), metavar="T", help="context lengths, in tokens (default 512 2048 "
                               "8192)")
    batch: int = opt(8, help="sequences per step (default 8)")
    repeats: int = opt(12, help="timed steps per (variant, context), in all rounds")
    warmup: int = opt(2, help="untimed steps per (variant, context, round)")
    rounds: int = opt(3, help="interleaved rounds the repeats are split over")
    max_seconds: Optional[float] = opt(None, help="cap on the seconds spent per (variant, context): slow variants "
                                       "(naive MLA at long contexts) then get fewer timed steps (>= 1 per round)")
    dtype: str = opt("fp32", choices=DTYPE_NAMES, help="default fp32 (bf16 is slow on CPU)")
    threads: Optional[int] = opt(None, help="torch.set_num_threads (default: torch's choice)")
    plot: Optional[str] = opt(None, metavar="PNG", help="plot path (default: next to --json)")
    profile: bool = opt(False, help="also run torch.profiler over 3 steps of each variant at the largest context: "
                        "top ops, and the largest copy/cat (must be far below one layer's cache)")

    def __post_init__(self) -> None:
        """Every context, count and number within its bound before a model is built (one line naming the option)."""
        if not self.config or not self.ctx:
            raise ValueError("--config and --ctx need at least one value each")
        for c in self.ctx:
            check_count("--ctx", c, 1, MAX_TOKENS - 1)
        check_count("--batch", self.batch)
        check_count("--repeats", self.repeats, 1, MAX_REPEATS)
        check_count("--warmup", self.warmup, 0, MAX_REPEATS)
        check_count("--rounds", self.rounds, 1, MAX_REPEATS)
        check_threads("--threads", self.threads)
        if self.max_seconds is not None:
            check_number("--max-seconds", self.max_seconds, 0.0, hi=1e6, lo_open=False)  # 11.6 days a cell

    @property
    def contexts(self) -> list[int]:
        """The contexts timed, ascending, each once."""
        return sorted(set(self.ctx))
