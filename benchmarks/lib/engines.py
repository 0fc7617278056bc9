"""What the engine studies share: a checkpoint or an in-memory model exported as a transformers folder, a trained
checkpoint beside its export, perplexity from logits, and one model's row in llama.cpp."""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

__all__ = ["export", "export_model", "in_llama_cpp", "ppl", "trained"]


def export(ckpt: Path, out: Path, fmt: str = "auto", pad: Optional[tuple[int, int]] = None,
           tokenizer: bool = True) -> Path:
    """``ckpt`` exported into ``out`` (replaced) by :func:`training.export.export`; ``pad``: the DeepSeek-V3 export's
    (latent, RoPE) widths. Its report goes to stderr (stdout is the study's)."""
    from training import export as ex

    with contextlib.redirect_stdout(sys.stderr):
        ex.export(ckpt, out, force=True, tokenizer=tokenizer, fmt=fmt, pad_latent=pad[0] if pad else None,
                  pad_rope=pad[1] if pad else None)
    return out


def export_model(model, out: Path, pad: Optional[tuple[int, int]] = None) -> Path:
    """A :class:`models.GPT` (random weights: no tokenizer) exported into ``out`` through a checkpoint beside it."""
    from models.checkpoint import save_model

    ckpt = save_model(model, out.with_suffix(".ckpt"))
    try:
        return export(ckpt, out, pad=pad, tokenizer=False)
    finally:
        ckpt.unlink()


@torch.no_grad()
def trained(ckpt: Path, text: str, tokens: int, work: Optional[Path], prefix: str):
    """``(model, cfg, meta, work, ids)``: ``ckpt`` loaded and exported into ``work/hf`` (default: a new temporary
    folder), ``ids`` the first ``tokens`` of ``text`` (at most the model's context) in the run's tokenizer."""
    import transformers

    from models.checkpoint import load_gpt_checkpoint

    model, cfg, meta = load_gpt_checkpoint(ckpt)
    work = Path(work or tempfile.mkdtemp(prefix=prefix))
    export(ckpt, work / "hf")
    ids = transformers.AutoTokenizer.from_pretrained(work / "hf")(text)["input_ids"]
    return model.eval(), cfg, meta, work, ids[: min(tokens, cfg.block_size)]


def ppl(logits, ids: Sequence[int]) -> float:
    """Perplexity of ``ids`` (T,) under next-token ``logits`` (T, V)."""
    lg, t = torch.as_tensor(logits).float(), torch.as_tensor(list(ids))
    return math.exp(torch.nn.functional.cross_entropy(lg[:-1], t[1:]).item())


def in_llama_cpp(gguf: Path, ids: Sequence[int], prompt: Sequence[int], new: int, n_ctx: int) -> dict[str, Any]:
    """``gguf`` in llama.cpp (f16 KV cache): perplexity of ``ids``, greedy ``new`` tokens after ``prompt``, its cache
    (log) and bytes per token."""
    from kvsplice.convert.engines.llama_cpp import LlamaCppModel

    with LlamaCppModel(gguf, n_ctx=n_ctx, cache_type="f16") as lm:
        return {"ppl": ppl(lm.logits(list(ids)), ids), "greedy": lm.greedy(list(prompt), new),
                "kv_bytes_per_token": lm.kv_bytes_per_token, "kv_cache": lm.kv_cache()}
