"""The options of the low-rank bases commands as typed objects, the declaration of their command lines too (each
field's flag, help and parser: :mod:`kvsplice.io.options`): :class:`BasesTextOptions`, what ``fit-bases`` and
``eval-bases`` share (the model, its tokenizer, the text's windows and how the run runs), and
:class:`FitBasesOptions`, what ``fit-bases`` fits (:mod:`kvsplice.evaluation.options` has ``eval-bases``')."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Optional

from kvsplice.core.amounts import check_times_smaller, times_fewer
from kvsplice.core.limits import MAX_TEXT_TOKENS, MAX_TOKENS, check_count, check_threads
from kvsplice.io.cli import pos_int
from kvsplice.io.options import Exclusive, opt
from kvsplice.io.run_options import RunOptions
from kvsplice.lowrank.fits import FITS

__all__ = ["BasesTextOptions", "CALIB_TOKENS", "FitBasesOptions"]

CALIB_TOKENS = 65536
"""``fit-bases --calib-tokens`` when not given."""


def _energy(s: str) -> float:
    """argparse type: a retained fraction of a spectrum, in (0, 1]."""
    v = float(s)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


@dataclass(frozen=True, kw_only=True)
class BasesTextOptions(RunOptions):
    """What a command over a model and windows of text shares: the ``model`` (and a ``tokenizer`` override), the
    window length ``seq_len`` (None: the model's context, at most 1024), ``batch_size`` windows per forward, the
    ``json`` report, and how the run runs (:class:`RunOptions`)."""

    model: str = opt(help="model directory with config.json (e.g. made by kvsplice convert-llama2c), a training "
                     ".ckpt, or a Hugging Face Hub id")
    tokenizer: Optional[str] = opt(None, help="override the model's tokenizer (HF tokenizer dir, GPT-2 BPE files or "
                                   "tokenizer.json)")
    seq_len: Optional[int] = opt(None, parse=pos_int, help="window length (default: the model's context, <= 1024)")
    batch_size: int = opt(8, parse=pos_int, help="windows per forward (default 8)")
    json: Optional[str] = opt(None, help="also write the report as JSON here")

    def _check_text_options(self) -> None:
        """The shared counts within their bounds (one line naming the option)."""
        check_threads("--threads", self.threads)
        if self.seq_len is not None:
            check_count("--seq-len", self.seq_len, 1, MAX_TOKENS)
        check_count("--batch-size", self.batch_size, 1, MAX_TOKENS)


@dataclass(frozen=True)
class FitBasesOptions(BasesTextOptions):
    """What ``fit-bases`` fits: every ``fit`` method × ``rope`` mode × key spec (``rank`` values, one ``energy``
    or ``alloc_ratio`` values; the value spec ``rank_v`` / ``energy_v`` defaults to it) from one calibration pass
    over ``calib_tokens`` of the ``calib`` text (statistics kept in / reused from ``calib_stats``), saved to
    ``out`` (a pattern for several). The fields declare the command line, in this order."""

    OPTION_GROUPS: ClassVar = (Exclusive(("rank", "energy", "alloc_ratio"), required=True),
                               Exclusive(("rank_v", "energy_v")))

    fit: tuple[str, ...] = opt(flags=("--fit", "--method"), choices=FITS, help="the fit (--method is its old name): "
                               "ksvd: K-only/V-only SVD; eigen: joint SVD of [K;Q]; kq / gqa-concat: attention-aware "
                               "(per-head scores), gqa-sum: attention-aware on the group-summed queries; kq/gqa-* "
                               "values are W_O-aware; fisher: loss-aware (calibration loss gradients)")
    rank: Optional[tuple[int, ...]] = opt(None, parse=pos_int, help="key rank(s) per KV head (<= head_dim)")
    energy: Optional[float] = opt(None, parse=_energy, help="per head, the smallest key rank retaining this "
                                  "fraction of the fit's spectrum (e.g. 0.9)")
    alloc_ratio: Optional[tuple[float, ...]] = opt(None, parse=times_fewer, help="ranks per layer, KV head and "
                                                   "keys/values chosen by the predicted calibration loss under "
                                                   "2·L·Hkv·head_dim / X numbers per token (X: times smaller than "
                                                   "the full K/V cache, >= 1)")
    rank_v: Optional[int] = opt(None, parse=pos_int, help="value rank (default: the key spec)")
    energy_v: Optional[float] = opt(None, parse=_energy, help="value energy (default: the key spec)")
    uniform_ranks: bool = opt(False, help="with --energy: raise every head of a layer to the layer's largest rank "
                              "(one cache stream per layer)")
    rope: tuple[str, ...] = opt(("post",), choices=("post", "pre"), help="RoPE models: project keys after (post, "
                                "default) or before (pre) the rotary embedding; both from one calibration pass; "
                                "ignored for models without RoPE")
    calib: str = opt(help="calibration text: .txt (<|endoftext|> or blank-line separated stories), .json, .jsonl, a "
                     "folder of them, or a Hugging Face dataset ID[:SPLIT]")
    calib_tokens: Optional[int] = opt(None, parse=pos_int, help=f"calibration tokens (default {CALIB_TOKENS}, or the "
                                      f"whole text if shorter; at most {MAX_TEXT_TOKENS} and what --calib can give)")
    calib_stats: Optional[str] = opt(None, help="calibration statistics file: reused when it exists (same model), "
                                     "written after the calibration pass otherwise")
    sensitivity: bool = opt(False, help="also record the loss gradients (needed by --method fisher and "
                            "--alloc-ratio, which turn it on; one backward pass per batch)")
    out: str = opt(help="output .safetensors file, or a pattern with {method}, {rope}, {rank} for several")
    bases_dtype: str = opt("fp32", choices=("fp32", "fp64"), help="dtype of the saved bases")
    forward_timing: bool = opt(True, flags=("--no-forward-timing",), help="skip the plain forward pass timing")

    def __post_init__(self) -> None:
        """The key spec given once, every count and ratio within its bound, before anything is read (one line
        naming the option)."""
        self._check_text_options()
        given = [n for n, v in (("--rank", self.rank), ("--energy", self.energy), ("--alloc-ratio",
                                                                                   self.alloc_ratio)) if v]
        if len(given) != 1:
            raise ValueError("give one of --rank, --energy and --alloc-ratio" + (f", not {' and '.join(given)}"
                                                                                  if given else ""))
        if self.rank_v is not None and self.energy_v is not None:
            raise ValueError("give --rank-v or --energy-v, not both")
        if self.uniform_ranks and self.energy is None:
            raise ValueError("--uniform-ranks raises the ranks --energy chooses per head; give --energy (with --rank "
                             "/ --alloc-ratio every head already has one rank)")
        for r in self.rank or ():
            check_count("--rank", r, 1, MAX_TOKENS)
        if self.rank_v is not None:
            check_count("--rank-v", self.rank_v, 1, MAX_TOKENS)
        for x in self.alloc_ratio or ():
            check_times_smaller("--alloc-ratio", x, allow_one=True)
        for e in (self.energy, self.energy_v):
            if e is not None and not 0.0 < e <= 1.0:
                raise ValueError(f"--energy must be in (0, 1], got {e}")
        if not self.fit or any(f not in FITS for f in self.fit):
            raise ValueError(f"--fit: choose from {', '.join(FITS)}, got {' '.join(self.fit) or 'none'}")

    def jobs(self) -> list[tuple[str, str, dict]]:
        """Every ``(method, rope, spec)`` asked for; ``spec``: ``rank`` / ``energy`` (+ the value spec) or
        ``alloc_ratio``."""
        vs = {"rank_v": self.rank_v, "energy_v": self.energy_v}
        if self.alloc_ratio:
            specs = [{"alloc_ratio": x} for x in self.alloc_ratio]
        elif self.rank:
            specs = [{"rank": r, "energy": None, **vs} for r in self.rank]
        else:
            specs = [{"rank": None, "energy": self.energy, **vs}]
        return [(m, rope, spec) for m in self.fit for rope in self.rope for spec in specs]
