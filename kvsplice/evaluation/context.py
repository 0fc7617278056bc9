"""The shared evaluation context of ``kvsplice eval-bases``: held-out windows decoded through any
:class:`~kvsplice.decode.Decoder`, the full-cache reference, and held-out Grams and exact q/k/v per RoPE mode,
each computed once."""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvsplice.adapters import model_fingerprint, model_info
from kvsplice.adapters.capture import extract_qkv
from kvsplice.core.method import layer_tokens
from kvsplice.decode import Decoder, DenseKV
from kvsplice.decode.decoder import chunked_nll
from kvsplice.lowrank.calibrate import calibrate
from kvsplice.report.memory import measure_cache

__all__ = ["EvalContext", "EvalError", "load_windows"]


class EvalError(RuntimeError):
    """A one-line error of the eval CLI."""


class EvalContext:
    """The model, the held-out windows and lazily computed, shared measurements (full-cache perplexity, held-out
    Grams and exact q/k/v per RoPE mode) for evaluating one or more compressed caches."""

    def __init__(self, loaded, windows: torch.Tensor, *, batch_size: int = 8, chunk_size: int = 64,
                 err_windows: int = 2, progress: bool = False, data_info: Optional[dict] = None) -> None:
        self.loaded, self.model = loaded, loaded.model
        self.info = model_info(self.model)
        self.fingerprint = model_fingerprint(self.model)
        self.windows = windows  # (N, T)
        self.batch_size, self.chunk_size = batch_size, chunk_size
        self.err_windows = max(1, min(err_windows, windows.shape[0]))
        self.progress = progress
        self.data_info = data_info or {}
        self._stats: dict[str, Any] = {}
        self._qkv: dict[str, Any] = {}
        self._full: Optional[dict] = None
        self._full_decoder = None

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def decode(self, decoder, desc: str = "decode") -> dict[str, Any]:
        """Summed NLL of every window through fresh caches of ``decoder`` (chunks of ``chunk_size``), the
        perplexity, and the first batch's cache measured after its last token."""
        n_win, t = self.windows.shape
        total, n_pred, measured = 0.0, 0, None
        t0 = time.perf_counter()
        batches = self.windows.split(self.batch_size)
        for bi, ids in enumerate(tqdm(batches, desc=desc, unit="batch", disable=not self.progress, leave=False)):
            nll, n, cache = chunked_nll(decoder, ids, self.chunk_size)
            total, n_pred = total + nll, n_pred + n
            if bi == 0:
                m = measure_cache(cache)
                measured = {"batch_size": ids.shape[0], "seq_len": cache.seq_len, "held": decoder.held(cache),
                            "dtype": str(cache.dtype)
                            .replace("torch.", ""), "element_size": torch.empty((), dtype=cache.dtype).element_size(),
                            "measured_live_bytes": m.live_bytes, "measured_storage_bytes": m.storage_bytes,
                            "nbytes": cache.nbytes(), "n_tensors": m.n_tensors, "kind": type(cache).__name__}
                formula = decoder.formula_nbytes(cache)
                if formula is not None:
                    measured["cache_bytes_formula"] = formula
        nll = total / max(n_pred, 1)
        return {"nll_per_token": nll, "ppl": math.exp(nll), "predicted_tokens": n_pred,
                "decode_s": time.perf_counter() - t0, "cache": measured}

    def full_kv_formula(self, batch_size: int, held, element_size: int) -> int:
        """``2·L·H_kv·d·T·B·bytes``; ``held``: ``T``, or the tokens each layer holds (sliding windows)."""
        i = self.info
        return 2 * i.n_kv_head * i.head_dim * layer_tokens(held, i.n_layer) * batch_size * element_size

    def full(self) -> dict[str, Any]:
        """Perplexity with the full K/V cache (``Decoder(model, DenseKV())``), the model's own forward perplexity,
        and the full cache's bytes — computed once."""
        if self._full is None:
            res = self.decode(self.family(), desc="full cache")
            c = res["cache"]
            c["formula_bytes"] = self.full_kv_formula(c["batch_size"], c["held"], c["element_size"])
            c["bytes_match"] = c["measured_live_bytes"] == c["formula_bytes"] == c["nbytes"]
            t0 = time.perf_counter()
            res["model_forward_ppl"] = self._forward_ppl()
            res["forward_s"] = time.perf_counter() - t0  # the plain forward every decode is timed against
            res["elements_per_token"] = 2 * self.info.n_layer * self.info.n_kv_head * self.info.head_dim
            self._full = res
        return self._full

    @torch.no_grad()
    def _forward_ppl(self) -> float:
        total, n = 0.0, 0
        for ids in self.windows.split(self.batch_size):
            out = self.model(input_ids=ids, use_cache=False) if hasattr(self.model, "config") else self.model(ids)
            logits = (out if isinstance(out, torch.Tensor) else out.logits).float()
            # (B·(T-1), V) logits vs (B·(T-1),) targets
            total += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                     reduction="sum").item()
            n += ids.shape[0] * (ids.shape[1] - 1)
        return math.exp(total / max(n, 1))

    # ------------------------------------------------------------------------------------------- held-out stats
    def rope_arg(self, rope: str) -> Optional[str]:
        return rope if self.info.has_rope and rope in ("post", "pre") else None

    def stats(self, rope: str):
        """Held-out Grams (all windows) in RoPE mode ``rope``."""
        key = self.rope_arg(rope) or "none"
        if key not in self._stats:
            self._stats[key] = calibrate(self.model, list(self.windows.split(self.batch_size)),
                                         rope=self.rope_arg(rope), progress=False)
        return self._stats[key]

    def qkv(self, rope: str) -> list[dict[str, torch.Tensor]]:
        """Exact q/k/v of the first ``err_windows`` windows in RoPE mode ``rope``."""
        key = self.rope_arg(rope) or "none"
        if key not in self._qkv:
            self._qkv[key] = extract_qkv(self.model, self.windows[: self.err_windows], rope=self.rope_arg(rope))
        return self._qkv[key]

    def family(self) -> Decoder:
        """The full-cache reference decoder (its adapter and scales serve every measurement)."""
        if self._full_decoder is None:
            self._full_decoder = Decoder(self.model, DenseKV())
        return self._full_decoder


def load_windows(loaded, spec: str, n_tokens: int, seq_len: int, progress: bool = False
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
    from kvsplice.loading import iter_texts, token_stream

    ids, n_stories = token_stream(iter_texts(spec, option="data", split="validation"), loaded.tokenizer, n_tokens,
                                  progress=progress, desc="tokenize data")
    n = ids.numel() // seq_len
    if n < 1:
        raise EvalError(f"--data {spec}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)  # (N, T)
    info = {"source": str(spec), "tokens": n * seq_len, "windows": n, "seq_len": seq_len, "stories": n_stories}
    if n * seq_len < n_tokens:
        info["note"] = f"asked for {n_tokens} tokens, used {n * seq_len} ({n} full windows of {seq_len})"
    return windows, info


