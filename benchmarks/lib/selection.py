"""Token selection scored on windows of text (``benchmarks/balance_ppl.py``): the selectors it compares, built by
name, and a continuation's NLL over a compressed prompt cache, beside the model's own full-attention NLL."""

from __future__ import annotations

import math

import torch

from kvsplice.select.method import run_token_selection
from kvsplice.select.selectors import BalanceKVSelector, StreamingLLMSelector, UniformSelector

__all__ = ["BLOCK", "COMPRESSED", "METHODS", "N_RECENT", "N_SINK", "evaluate", "hf_reference_nll", "make"]

METHODS = ("full", "balancekv", "uniform", "streamingllm", "coinflip")
COMPRESSED = METHODS[1:]
N_SINK, N_RECENT, BLOCK = 4, 16, 64


def make(method: str, seed: int):
    if method == "balancekv":
        return BalanceKVSelector(n_sink=N_SINK, n_recent=N_RECENT, block_size=BLOCK, seed=seed)
    if method == "coinflip":  # ablation: BalanceKV's plan and blocks, every halving a fair coin (c = inf)
        return BalanceKVSelector(n_sink=N_SINK, n_recent=N_RECENT, block_size=BLOCK, c_scale=math.inf, seed=seed)
    if method == "uniform":
        return UniformSelector(n_sink=N_SINK, n_recent=N_RECENT, seed=seed)
    if method in ("streamingllm", "full"):
        return StreamingLLMSelector(n_sink=N_SINK, seed=seed)
    raise ValueError(method)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, prompt: int, method: str, budget: int, seed: int, batch: int) -> dict:
    """Total NLL / tokens of the continuation over all windows for one method, budget and seed."""
    sel = make(method, seed)
    total, n = 0.0, 0
    nbytes = full = 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch]
        res = run_token_selection(model, ids, sel, budget, prompt_len=prompt)
        total += res.nll * res.n_scored
        n += res.n_scored
        nbytes, full = res.cache_nbytes, res.full_nbytes
    return {"nll": total / n, "ppl": math.exp(total / n), "tokens": n, "cache_nbytes_last_batch": nbytes,
            "full_nbytes_last_batch": full}


@torch.no_grad()
def hf_reference_nll(model, windows: torch.Tensor, prompt: int, batch: int) -> float:
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch]
        out = model(ids)
        logits = (out if isinstance(out, torch.Tensor) else out.logits)[:, prompt - 1:-1].float()
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, prompt:].reshape(-1),
                                                   reduction="sum").item()
        n += ids[:, prompt:].numel()
    return total / n
