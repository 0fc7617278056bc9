"""Attention-score selectors (SnapKV, ObservedAttention) against a direct per-head reference written from the
papers' definitions, and through the one decoder on left-padded batches."""

from __future__ import annotations

import math

import pytest
import torch

from kvsplice.select.scores import ObservedAttentionSelector, SnapKVSelector
from kvsplice.select.method import TokenSelection
from kvsplice.decode import Decoder
from test_stack import ids_of, tiny


def _qk(h=2, g=3, t=20, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(h, g * t, d, generator=gen), torch.randn(h, t, d, generator=gen), torch.randn(h, t, d)


def _attention(q, k, scale):
    """Per KV head, query head and position: the causal softmax row (written with loops)."""
    h, t, _ = k.shape
    g = q.shape[1] // t
    a = torch.zeros(h, g, t, t)
    for j in range(h):
        for r in range(g):
            for i in range(t):
                s = torch.tensor([float(q[j, r * t + i] @ k[j, c]) * scale for c in range(i + 1)])
                a[j, r, i, :i + 1] = torch.softmax(s, 0)
    return a


def test_observed_attention_keeps_the_most_attended_tokens_per_query_that_sees_them():
    q, k, v = _qk()
    scale = 1 / math.sqrt(8)
    a = _attention(q, k, scale)
    want = a.sum(dim=(1, 2)) / torch.arange(20, 0, -1)
    idx, logw = ObservedAttentionSelector(chunk=7).select(k, v, 6, q=q, scale=scale)
    assert torch.equal(idx, want.topk(6, -1).indices.sort(-1).values) and not logw.any()


@pytest.mark.parametrize("stride,chunk", [(3, 2), (4, 64), (19, 1), (25, 3)])
def test_observed_attention_with_a_stride_counts_only_the_voting_queries(stride, chunk):
    """Queries at 19, 19 - stride, ... vote; each token's sum is divided by the voting queries that see it."""
    q, k, v = _qk(seed=2)
    scale = 1 / math.sqrt(8)
    voters = list(range(19, -1, -stride))
    a = _attention(q, k, scale)[:, :, voters]  # (H, g, voters, T)
    seen = torch.tensor([sum(p >= j for p in voters) for j in range(20)], dtype=torch.float32).clamp_min(1)
    want = a.sum(dim=(1, 2)) / seen
    idx, _ = ObservedAttentionSelector(stride=stride, chunk=chunk).select(k, v, 6, q=q, scale=scale)
    assert torch.equal(idx, want.topk(6, -1).indices.sort(-1).values)


def test_snapkv_keeps_its_window_and_the_pooled_votes():
    q, k, v = _qk(seed=1)
    scale = 0.5
    votes = _attention(q, k, scale)[:, :, -4:].sum(dim=(1, 2))  # (H, T): the last 4 queries vote
    pooled = torch.stack([torch.stack([votes[j, max(0, c - 1):c + 2].mean() for c in range(20)]) for j in range(2)])
    idx, _ = SnapKVSelector(window=4, kernel=3).select(k, v, 9, q=q, scale=scale)
    for j in range(2):
        rest = pooled[j, :16].topk(5).indices
        assert idx[j].tolist() == sorted(rest.tolist() + [16, 17, 18, 19])


def test_score_selectors_decode_padded_rows_as_alone():
    model = tiny("llama")
    seqs = [ids_of(1, t, 20 + t)[0] for t in (16, 11)]
    for sel in (SnapKVSelector(window=3, kernel=3), ObservedAttentionSelector()):
        method = TokenSelection(sel, 6)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        from kvsplice.hf import KVSpliceHFCache

        ids = torch.zeros(2, 16, dtype=torch.long)
        mask = torch.zeros(2, 16, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, 16 - len(s):], mask[i, 16 - len(s):] = s, 1
        with torch.no_grad():
            batched = model.generate(ids, attention_mask=mask, past_key_values=KVSpliceHFCache(model, method), **kw)
        for i, s in enumerate(seqs):
            alone = Decoder(model, method).generate(s[None], 4)[0, len(s):]
            assert torch.equal(batched[i, 16:], alone), (sel, i)


def test_expected_attention_is_the_gaussian_expectation_and_keeps_sinks_window_and_top():
    from kvsplice.select.expected import ExpectedAttentionSelector

    q, k, v = _qk(h=2, g=3, t=30, d=4, seed=3)
    scale = 0.5
    sel = ExpectedAttentionSelector(window=10, n_sink=2)
    got = sel.scores(k, v, q, scale)  # (H, T)
    gen = torch.Generator().manual_seed(0)
    for j in range(2):  # Monte Carlo: q ~ N(mean, cov) of the last 10 queries of the 3 heads -> E[exp(s q.k)]
        last = q[j].reshape(3, 30, 4)[:, 20:].reshape(-1, 4).double()
        mu, cov = last.mean(0), torch.cov(last.T)
        z = torch.randn(400_000, 4, generator=gen, dtype=torch.float64)
        samples = mu + z @ torch.linalg.cholesky(cov).T
        e = torch.exp(scale * samples @ k[j].double().T).mean(0)  # (T,)
        want = e / e.sum() * v[j].double().norm(dim=-1)
        torch.testing.assert_close(got[j].double(), want, rtol=0.03, atol=1e-4)
    idx, logw = sel.select(k, v, 15, q=q, scale=scale)
    for j in range(2):
        s = got[j].clone()
        s[:2] = float("inf")
        s[20:] = float("inf")  # sinks and the last 10 (the window) first, then the 3 highest of the rest
        assert idx[j].tolist() == sorted(s.topk(15).indices.tolist()) and not logw.any()
