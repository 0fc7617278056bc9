"""The one check every size a user gives goes through before memory is touched: counts within ``[lo, hi]``, numbers
finite, thread counts within the machine's CPUs, and an estimate of the bytes a run allocates against the memory
the machine (or GPU) has free. Each failure is one ``ValueError`` line naming the option (the CLIs print it as
``PROG: error: ...``, exit 2), so ``--seq-lens 1000000000`` is refused up front instead of asking torch for
terabytes. Memory is read without psutil: ``/proc/meminfo``'s ``MemAvailable``, else ``os.sysconf``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

from kvsplice.core.args import MAX_TOKENS

__all__ = ["MAX_LEARNING_RATE", "MAX_TEXT_TOKENS", "MAX_TOKENS", "available_bytes", "check_count", "check_fits", "check_number",
           "check_text_tokens", "check_threads", "check_training_fits", "cpu_count", "fmt_bytes", "gpt_run_bytes",
           "text_token_bound"]

MAX_LEARNING_RATE = 1.0
"""The largest learning rate a run accepts: an AdamW step of more than 1 per unit gradient moves every weight by
about its own size and the run diverges at the first step (the usual range is 1e-5 to 1e-2)."""

MAX_TEXT_TOKENS = 1 << 24
"""The most tokens of calibration / evaluation text one run tokenises and holds (16,777,216: far more than a fit
or an evaluation needs; the token ids alone are ~0.6 GB while being collected)."""


def fmt_bytes(n: float) -> str:
    """``n`` bytes as ``"3.0 TB"`` / ``"512.0 MB"`` (powers of 1000, one decimal)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(device: Any = None) -> int:
    """Bytes a run may still allocate on ``device`` (a ``torch.device`` or name; ``None``/CPU: this machine's free
    RAM; CUDA: the GPU's free memory)."""
    kind = getattr(device, "type", None) or (str(device).split(":")[0] if device is not None else "cpu")
    if kind == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    got = _meminfo_available()
    if got is not None:
        return got
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_count(option: str, value: Any, lo: int = 1, hi: int = MAX_TOKENS, why: str = "") -> int:
    """``value`` as an integer in ``[lo, hi]``, else ``ValueError("OPTION must be >= lo, got ...")`` (or ``<= hi``,
    with ``why``: what sets the upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{option} must be an integer in [{lo}, {hi}], got {value!r}")
    if value < lo:
        raise ValueError(f"{option} must be >= {lo}, got {value}")
    if value > hi:
        raise ValueError(f"{option} must be <= {hi}{f' ({why})' if why else ''}, got {value}")
    return int(value)


def check_number(option: str, value: Any, lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = True) -> float:
    """``value`` as a finite number ``> lo`` (``>= lo`` unless ``lo_open``) and ``<= hi`` (never NaN or inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{option} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{option} must be a finite number, got {value!r}")
    if v < lo or (lo_open and v == lo) or v > hi:
        upper = f" and <= {hi:g}" if hi < math.inf else ""
        raise ValueError(f"{option} must be {'>' if lo_open else '>='} {lo:g}{upper}, got {value!r}")
    return v


def text_token_bound(nbytes: int) -> int:
    """The most tokens ``nbytes`` of text can give under any tokenizer: at most one token per byte (byte-level and
    byte-fallback tokenizers) plus BOS, EOS and a word-start marker per story, and a story takes at least one
    byte and a separator."""
    return 3 * int(nbytes) + 3


def check_text_tokens(option: str, value: Any, *, text_option: str, text_bytes: Optional[int],
                      given: bool = True) -> int:
    """A count of text tokens (``--calib-tokens``, ``--tokens``) within :data:`MAX_TEXT_TOKENS` and, when the user
    gave it (``given``), within what ``text_option``'s ``text_bytes`` can give (``None``: unknown, e.g. a Hub
    dataset). A default larger than the text is fine: the run uses the whole text and says so."""
    n = check_count(option, value, 1, MAX_TEXT_TOKENS, "the most text tokens a run holds")
    if given and text_bytes is not None and n > text_token_bound(text_bytes):
        raise ValueError(f"{option} {n}: {text_option} holds {fmt_bytes(text_bytes)} of text, at most "
                         f"{text_token_bound(text_bytes):,} tokens under any tokenizer")
    return n


def check_threads(option: str, value: Any) -> Optional[int]:
    """A thread count within this machine's CPUs (``None`` passes: the library's default)."""
    if value is None:
        return None
    return check_count(option, value, 1, cpu_count(), "the CPUs this process may use")


def check_fits(option: str, nbytes: float, what: str, device: Any = None, available: Optional[int] = None) -> None:
    """Refuse a run whose big allocation (``nbytes``, estimated from the sizes the user gave) exceeds the memory
    free on ``device`` (``available`` overrides the reading, for tests)."""
    free = available_bytes(device) if available is None else int(available)
    if not math.isfinite(nbytes) or nbytes > free:
        where = "the GPU" if getattr(device, "type", str(device)).startswith("cuda") else "this machine"
        raise ValueError(f"{option}: {what} needs about {fmt_bytes(nbytes)}, more than the {fmt_bytes(free)} "
                         f"{where} has free")


def gpt_run_bytes(cfg: Any, *, tokens: int, batch: int, elt: int, cache_bytes: int, logits_tokens: int) -> int:
    """A lower estimate of what running a :class:`models.config.GPTConfig` model allocates: its weights (embeddings
    of ``vocab_size`` and ``block_size`` rows, ~12·d² per layer) at ``elt`` bytes, the token ids ``(batch, tokens)``
    (int64), the cache (``cache_bytes``) and the fp32 logits of ``logits_tokens`` positions per sequence."""
    d, vocab = int(cfg.d_model), int(getattr(cfg, "vocab_size", None) or 0)  # unknown before the data: 0
    weights = (vocab + int(cfg.block_size)) * d + int(cfg.n_layer) * 12 * d * d
    return weights * elt + 8 * batch * tokens + int(cache_bytes) + 4 * batch * logits_tokens * vocab


def check_training_fits(cfg: Any, batch: int, device: Any = None) -> None:
    """Refuse a training run of ``cfg`` (a GPT config or the CLI's ``model`` namespace) at ``batch`` sequences of
    ``cfg.block_size`` whose lower-bound footprint exceeds the free memory: fp32 weights, gradients and two Adam
    moments (16 bytes a parameter) and each layer's saved input for the backward pass (``batch·block·d`` fp32)."""
    block = check_count("--model.block_size", cfg.block_size)
    batch = check_count("--data.batch_size", batch)
    saved = 4 * batch * block * int(cfg.d_model) * int(cfg.n_layer)
    need = gpt_run_bytes(cfg, tokens=block, batch=batch, elt=16, cache_bytes=saved, logits_tokens=0)
    check_fits(f"--model.block_size {block} with --data.batch_size {batch}", need,
               "training (weights, optimiser state, saved activations)", device)
