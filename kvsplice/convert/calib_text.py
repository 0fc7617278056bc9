"""``kvsplice to-mla --calib SOURCE...``: the calibration tokens, from one source or several.

A source is a text (a file, a folder, a dataset id) or ``self``, the source model's own text
(:mod:`kvsplice.loading.self_text`, sampled once and cached). Each of ``n`` sources gives ``tokens / n`` tokens, cut
into windows of ``seq_len`` and interleaved window by window: the statistics weigh the sources equally and the
windows the conversion keeps (to choose and correct each layer on) come from the first ones, in turn. One domain's
text keeps that domain and loses the rest (docs/conversion.md): ``--calib self STORIES`` keeps both.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvsplice.convert.to_mla_options import SELF_CALIB
from kvsplice.io.cli import UsageError

__all__ = ["calibration_ids"]


def _source_ids(source: str, tokenizer, tokens: int, model, max_positions: Optional[int], progress: bool
                ) -> torch.Tensor:
    """Up to ``tokens`` ids ``(n,)`` of one source."""
    if source == SELF_CALIB:
        from kvsplice.loading.self_text import SelfTextError, SelfTextOptions, self_text

        try:
            return self_text(model, tokenizer, SelfTextOptions(tokens=tokens), max_positions=max_positions,
                             progress=progress).ids
        except SelfTextError as e:
            raise UsageError(f"--calib self is the source's own text: {e}; give --calib TEXT") from None
    from kvsplice.loading import iter_texts, token_stream

    return token_stream(iter_texts(source, option="calib"), tokenizer, tokens)[0]


def calibration_ids(sources: Sequence[str], tokenizer, tokens: int, seq_len: int, *, model=None,
                    max_positions: Optional[int] = None, progress: bool = False) -> torch.Tensor:
    """The calibration stream ``(N·seq_len,)``: ``tokens // len(sources)`` of each source in whole windows of
    ``seq_len``, interleaved window by window (one source: its tokens as they come)."""
    share = tokens // len(sources)
    if share < seq_len:
        raise UsageError(f"--seq-len {seq_len} is longer than each source's calibration tokens ({share} = "
                         f"--calib-tokens {tokens} / {len(sources)} sources): give a shorter --seq-len or more "
                         f"--calib-tokens")
    parts = []
    for source in sources:
        ids = _source_ids(source, tokenizer, share, model, max_positions, progress)
        if ids.numel() < seq_len:
            raise UsageError(f"--calib {source}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
        parts.append(ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len))  # (n_i, T)
    rows = [p[i] for i in range(max(len(p) for p in parts)) for p in parts if i < len(p)]
    return torch.stack(rows).reshape(-1)  # (Σ n_i · T,)
