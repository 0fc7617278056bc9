"""The options of the BalanceKV bench (``kvsplice bench-balance``) as one typed object: the declaration of its
command line too (each field's flag, help and parser: :mod:`kvsplice.io.options`), and what
:func:`kvsplice.select.experiment.run_bench` takes — one set of defaults for the command and the library."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsplice.core.limits import check_number, check_threads
from kvsplice.io.cli import pos_int
from kvsplice.io.options import check_counts, count, opt
from kvsplice.io.run_options import ForceOption

__all__ = ["ARMS", "BenchBalanceOptions", "MAX_SEEDS"]

ARMS = ("balancekv", "uniform", "coinflip")
"""The selectors the BalanceKV bench compares (its arms; ``coinflip``: BalanceKV with coin-flip halving)."""

MAX_SEEDS = 1000
"""The most ``--seeds`` (selections per window and KV head): the run's time grows with it."""


@dataclass(frozen=True, kw_only=True)
class BenchBalanceOptions(ForceOption):
    """What ``bench-balance`` measures: the ``model`` (and its ``tokenizer``), ``windows`` windows of ``context``
    tokens of the ``data`` text (the last ``n_queries`` of each are the queries), the ``layers``, the halvings
    ``T``, the ``methods`` (arms) with ``seeds`` selections each, what is kept intact (``n_sink``, ``n_recent``)
    and the walk's ``block_size`` / ``c_scale`` / ``kernel_temp``; then the outputs. The fields declare the command
    line, in this order."""

    model: str = opt(help="HF model directory (config.json + tokenizer) or a .ckpt")
    tokenizer: Optional[str] = opt(None, help="tokenizer override (see kvsplice.loading)")
    data: str = opt(help="text: .txt/.json/.jsonl file or folder of stories")
    layers: Optional[tuple[int, ...]] = count(None, lo=0, help="layers (default: all)")
    T: tuple[int, ...] = count((1, 2, 3, 4), lo=0, hi=30, why="a compression of 2^30",
                               help="halvings (compression 2^T of the middle)")
    seeds: int = count(10, hi=MAX_SEEDS, why="the run's time grows with it",
                       help=f"selections per window and KV head (default 10, at most {MAX_SEEDS})")
    n_queries: int = count(64, help="query positions at the end of each window (default 64)")
    context: Optional[int] = count(None, lo=2, help="tokens per window (default: min(1024, positions))")
    windows: int = count(4, help="text windows (one selection per window and KV head)")
    n_sink: int = count(4, lo=0, help="first tokens kept intact (default 4)")
    n_recent: int = count(16, lo=0, help="last context tokens kept intact (default 16)")
    block_size: int = opt(64, help="tokens per block of the block-parallel halving (an even number, default 64)")
    c_scale: float = opt(1.0, help="walk threshold c = c_scale * median kappa")
    kernel_temp: float = opt(1.0, help="walk kernel exp(kernel_temp * <k,k'> / sqrt(d)) (1 = the paper's)")
    methods: tuple[str, ...] = opt(ARMS, flags=("--arms", "--methods"), choices=ARMS,
                                   help="the selectors compared (--methods is the old name)")
    json: Optional[str] = opt(None, help="write the report here (and the plot next to it, .png)")
    markdown: bool = opt(False, help="print a markdown table instead of a rich table")
    threads: int = opt(1, parse=pos_int, help="torch threads (default 1)")

    def __post_init__(self) -> None:
        """Every count and number within its range before the text or the model is read (the model's own limits,
        its layers and positions, are checked once it is loaded); one line naming the option."""
        check_threads("--threads", self.threads)
        check_counts(self)
        check_number("--c-scale", self.c_scale, hi=1e6)  # beyond, the walk's threshold exceeds every kappa
        check_number("--kernel-temp", self.kernel_temp, hi=1e3, lo_open=False)  # beyond, exp() overflows in fp32
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"--block-size must be an even number >= 2, got {self.block_size}")
        for m in self.methods:
            if m not in ARMS:
                raise ValueError(f"unknown selector {m!r}; choose from {', '.join(ARMS)}")
