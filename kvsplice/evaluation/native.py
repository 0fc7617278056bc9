"""``eval_bases --model MLA_DIR``: a model that decodes with its own cache (a converted MLA folder) has no bases to
evaluate; its own cache is measured instead, by the protocol of :func:`kvsplice.evaluation.protocol.evaluate`
(``--prompt-len`` tokens in the cache, the rest scored; 0: every token over the cache), with its measured bytes
(== the formula) against the source's fp16 full K/V cache."""

from __future__ import annotations

from typing import Any

from kvsplice.evaluation.context import EvalError, load_windows
from kvsplice.evaluation.options import EvalBasesOptions

__all__ = ["eval_native"]


def eval_native(opts: EvalBasesOptions, loaded) -> dict[str, Any]:
    """The own cache of ``loaded`` (the model ``opts.model``) on ``opts.eval_tokens`` of ``opts.data``."""
    from kvsplice.evaluation.protocol import evaluate
    from kvsplice.io.cli import default_seq_len

    if opts.bases or opts.plan:
        raise EvalError(f"--model {opts.model} caches its own latent: post-training --bases / --plan need the source "
                        f"model; leave them out to measure its cache")
    seq_len = opts.seq_len or default_seq_len(loaded.max_positions)
    if loaded.max_positions is not None and seq_len > loaded.max_positions:
        raise EvalError(f"--seq-len {seq_len} exceeds the model's {loaded.max_positions} positions")
    windows, info = load_windows(loaded, opts.data, opts.eval_tokens, seq_len, opts.progress)
    p = opts.prompt_len or 0
    if p and not 1 <= p < seq_len:
        raise EvalError(f"--prompt-len must be 0 or in [1, {seq_len - 1}] (below --seq-len), got {p}")
    res = evaluate(loaded.model, None, windows, prompt_len=p, batch_size=opts.batch_size,
                   decode_chunk=opts.chunk_size)
    res.update(label="own cache", data=info)
    return res
