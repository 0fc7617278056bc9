"""The options of ``eval-bases`` as one typed object, the declaration of its command line too (each field's flag,
help and parser: :mod:`kvsplice.io.options`), and what the evaluators of :mod:`kvsplice.evaluation` take:
:class:`EvalBasesOptions` over the group it shares with ``fit-bases``
(:class:`~kvsplice.lowrank.options.BasesTextOptions`) and the options of ``--method fd-online``
(:class:`FdOnlineOptions`, their own group in ``--help``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from kvsplice.core.limits import MAX_TEXT_TOKENS, check_count
from kvsplice.io.cli import pos_int
from kvsplice.io.options import opt
from kvsplice.lowrank.options import BasesTextOptions

__all__ = ["EVAL_TOKENS", "EvalBasesOptions", "FdOnlineOptions"]

EVAL_TOKENS = 16384
"""``eval-bases --tokens`` when not given."""


@dataclass(frozen=True, kw_only=True)
class FdOnlineOptions:
    """``--method fd-online``: online Frequent-Directions bases per chunk (:mod:`kvsplice.online.method`): ranks
    ``rank`` / ``rank_v``, sketch size ``ell``, the residual thresholds (``tau_k`` / ``tau_v``, or calibrated at
    ``tau_percentile`` on ``tau_calib``), the chunking (``max_chunk_len``, ``max_chunks``, ``min_chunk_len``),
    ``warmup`` and ``fd_decay``."""

    GROUP: ClassVar[str] = "--method fd-online (online FD bases per chunk, no calibration; kvsplice.online.method)"

    rank: int = opt(4, parse=pos_int, help="key rank r_k per chunk (default 4)")
    rank_v: Optional[int] = opt(None, parse=pos_int, help="value rank r_v (default: --rank)")
    ell: Optional[int] = opt(None, parse=pos_int, help="FD sketch size ℓ (default 2·max rank)")
    tau_k: Optional[float] = opt(None, help="close the chunk when a key's residual norm exceeds τ_k (default: no "
                                 "residual closes)")
    tau_v: Optional[float] = opt(None, help="the same for values (default: none)")
    relative: bool = opt(False, help="τ relative to ‖k‖ / ‖v‖ instead of absolute")
    max_chunk_len: int = opt(256, parse=pos_int, help="max tokens per chunk L (default 256)")
    max_chunks: Optional[int] = opt(None, parse=pos_int, help="merge cap J_max (default: never merge)")
    min_chunk_len: int = opt(1, parse=pos_int, help="no residual close below this length")
    warmup: int = opt(16, help="warm-up tokens kept at full dimension (default 16)")
    fd_decay: float = opt(1.0, help="forgetting factor γ of the sketches (default 1)")
    tau_percentile: Optional[float] = opt(None, metavar="P", help="set τ_k/τ_v to the P-th percentile (0-100) of the "
                                          "per-token residuals on --tau-calib text, decoded with thresholds off (one "
                                          "scalar each, pooled over layers; "
                                          "kvsplice.online.method.calibrate_thresholds)")
    tau_calib: Optional[str] = opt(None, metavar="PATH", help="calibration text for --tau-percentile (required with "
                                   "it; never the --data text); --tokens and --seq-len as for --data")

    def online_kw(self) -> dict:
        """The keyword arguments of :class:`~kvsplice.online.method.OnlineDecoder` (``rank_v``: ``rank`` when not
        given)."""
        return dict(rank_k=self.rank, rank_v=self.rank_v or self.rank, ell=self.ell, tau_k=self.tau_k,
                    tau_v=self.tau_v, relative=self.relative, max_chunk_len=self.max_chunk_len,
                    max_chunks=self.max_chunks, min_chunk_len=self.min_chunk_len, warmup=self.warmup,
                    fd_decay=self.fd_decay)


@dataclass(frozen=True)
class EvalBasesOptions(BasesTextOptions, FdOnlineOptions):
    """What ``eval-bases`` measures: the ``method`` (``static``: the saved ``bases`` files; ``fd-online``; or any
    method spec, or a ``plan``) on ``tokens`` of the held-out ``data`` text cut into windows, decoded
    ``chunk_size`` tokens per call (``prompt_len`` compressed first for a spec or plan), with the per-layer
    ``diagnostics`` on ``err_windows`` windows and the ``cache_quant`` variants. The fields declare the command
    line, in this order (then the shared ones, then fd-online's group)."""

    method: str = opt("static", metavar="SPEC", help="a compression method by its spec (kivi4, "
                      "select:snapkv@0.25+int8, lowrank:FILE+int8, a .json spec file), or an evaluator: static (the "
                      "--bases files, default) / fd-online")
    bases: Optional[tuple[str, ...]] = opt(None, help="bases .safetensors file(s) from kvsplice fit-bases")
    data: str = opt(help="held-out text: .txt/.json/.jsonl file or folder, or a Hugging Face dataset ID[:SPLIT] "
                    "(default split: validation)")
    tokens: Optional[int] = opt(None, parse=pos_int, help=f"evaluation tokens (default {EVAL_TOKENS}, or the whole "
                                f"text if shorter; at most {MAX_TEXT_TOKENS} and what --data can give)")
    chunk_size: int = opt(64, parse=pos_int, help="tokens appended to the cache per decoder call (default 64; 1 = "
                          "token by token; the result does not depend on it)")
    err_windows: int = opt(2, parse=pos_int, help="windows for the direct attention-output error (default 2)")
    cache_quant: Optional[str] = opt(None, choices=("int8",), help="also decode every --bases file (and the full K/V "
                                     "cache) with the cache stored as int8 rows + fp16 scales: perplexity and "
                                     "measured bytes")
    diagnostics: bool = opt(False, help="also the per-layer errors on held-out Grams, the float64 attention-output "
                            "errors and the attention-error bound diagnostics (slow: off by default)")
    plan: Optional[str] = opt(None, help="evaluate a plan from kvsplice plan (instead of --bases)")
    prompt_len: Optional[int] = opt(None, help="with --plan / --method SPEC: prompt tokens compressed per window, the "
                                    "rest scored (default: 3/4 of the window for a token selection, else 0 = every "
                                    "token over the compressed cache)")

    def __post_init__(self) -> None:
        """Every count within its bound before anything is read (``tokens``: against the text too, by
        :func:`kvsplice.loading.text_tokens`); a ``prompt_len`` is refused even where no method reads it (bases
        alone): never ignored silently."""
        self._check_text_options()
        if self.prompt_len is not None:
            check_count("--prompt-len", self.prompt_len, 0)
        for option, value in (("--chunk-size", self.chunk_size), ("--err-windows", self.err_windows)):
            check_count(option, value, 1, MAX_TEXT_TOKENS)

    @property
    def eval_tokens(self) -> int:
        """The evaluation tokens: ``tokens``, else :data:`EVAL_TOKENS`."""
        return self.tokens or EVAL_TOKENS
