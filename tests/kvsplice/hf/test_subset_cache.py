"""Token-subset cache: weighted attention anchored to ``attend``, the estimator, byte accounting, the GPT driver."""

import math

import pytest
import torch

from kvsplice.report.memory import measure_cache
from kvsplice.core.attention import weighted_attend
from kvsplice.select.cache import SubsetCache, subset_bytes
from kvsplice.select.method import run_token_selection
from kvsplice.select.selectors import BalanceKVSelector, StreamingLLMSelector, UniformSelector
from models import GPT, GPTConfig
from models.attention import attend




def selectors():
    return [BalanceKVSelector(n_sink=2, n_recent=4, block_size=8), UniformSelector(n_sink=2, n_recent=4),
            StreamingLLMSelector(n_sink=2)]


# ------------------------------------------------------------------------------------------ weighted_attend
@pytest.mark.parametrize("t_q,t_k,g", [(1, 9, 1), (9, 9, 1), (5, 5, 2), (4, 9, 1), (4, 9, 3), (1, 7, 2)])
def test_weighted_attend_with_zero_weights_is_attend(t_q, t_k, g):
    torch.manual_seed(0)
    b, hkv, d = 2, 2, 8
    q = torch.randn(b, hkv * g, t_q, d)
    k, v = torch.randn(b, hkv, t_k, d), torch.randn(b, hkv, t_k, 5)
    ref = attend(q, k, v, scale=0.3)
    torch.testing.assert_close(weighted_attend(q, k, v, None, scale=0.3), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(weighted_attend(q, k, v, torch.zeros(b, hkv, t_k, 1), scale=0.3), ref,
                               atol=1e-6, rtol=0)


def test_weighted_attend_is_the_weighted_estimator():
    torch.manual_seed(1)
    b, hkv, g, t_k, d = 1, 2, 2, 11, 4
    q = torch.randn(b, hkv * g, 3, d)
    k, v = torch.randn(b, hkv, t_k, d), torch.randn(b, hkv, t_k, 3)
    logw = torch.rand(b, hkv, t_k) * 2
    got = weighted_attend(q, k, v, logw, scale=0.5)
    for h in range(hkv * g):
        kv = h // g
        for i in range(3):  # query i sees keys 0 .. t_k - 3 + i
            n = t_k - 3 + i + 1
            w = torch.exp(logw[0, kv, :n].double()) * torch.exp(k[0, kv, :n].double() @ q[0, h, i].double() * 0.5)
            est = (w @ v[0, kv, :n].double()) / w.sum()
            torch.testing.assert_close(got[0, h, i].double(), est, atol=1e-6, rtol=0)


# -------------------------------------------------------------------------------------------------- cache
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subset_cache_holds_the_estimator_and_counts_its_bytes(dtype):
    torch.manual_seed(2)
    n_layer, b, hkv, d, t, budget, n_new = 2, 2, 3, 8, 40, 12, 5
    cache = SubsetCache(n_layer, hkv, d, b, dtype=dtype, capacity=budget + n_new)
    sel = BalanceKVSelector(n_sink=2, n_recent=4, block_size=8)
    k, v = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    chosen = []
    for layer in range(n_layer):
        sel.reseed(layer)
        idx, logw = sel.select(k.reshape(b * hkv, t, d), v.reshape(b * hkv, t, d), budget)  # batch folded into heads
        chosen.append([(idx.view(b, hkv, -1)[i], logw.view(b, hkv, -1)[i]) for i in range(b)])
        sel.reseed(layer)
        out = cache.compress_prefill(layer, k, v, sel, budget)
        assert out["k"].shape == (b, hkv, budget, d) and out["w"].shape == (b, hkv, budget, 1)
    assert cache.seq_len == budget and cache.n_seen == t
    el = torch.empty((), dtype=dtype).element_size()
    assert cache.nbytes() == subset_bytes(n_layer, b, hkv, d, d, budget, dtype)
    assert cache.nbytes() == n_layer * b * hkv * budget * (2 * d + 1) * el
    # the cache's weighted attention (one decode query over the compressed prefill) is the selector's estimator
    q = torch.randn(b, hkv, 1, d)
    kv = cache.get(0)
    got = weighted_attend(q, kv["k"], kv["v"], kv["w"], scale=d ** -0.5)
    for i in range(b):
        idx, logw = chosen[0][i]
        for h in range(hkv):
            kk, vv = k[i, h, idx[h]].to(dtype).double(), v[i, h, idx[h]].to(dtype).double()
            w = torch.exp(logw[h].to(dtype).double() + kk @ q[i, h, 0].double() * d ** -0.5)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[i, h, 0].double(), (w @ vv) / w.sum(), atol=tol, rtol=0)
    # decode tokens are kept exactly, with log-weight 0, and counted
    for step in range(n_new):
        for layer in range(n_layer):
            new = {name: torch.randn(b, hkv, 1, d, dtype=dtype) for name in ("k", "v")}
            out = cache.append(layer, **new)
            assert bool((out["w"][..., budget:, :] == 0).all())
    assert cache.seq_len == budget + n_new and cache.n_seen == t + n_new
    formula = subset_bytes(n_layer, b, hkv, d, d, budget + n_new, dtype)
    meas = measure_cache(cache)
    assert cache.nbytes() == formula == meas.live_bytes == meas.storage_bytes == cache.storage_nbytes()
    if hasattr(cache, "truncate"):  # rolling back decode tokens rolls back the positions too
        cache.truncate(budget + 2)
        assert cache.seq_len == budget + 2 and cache.n_seen == t + 2
    with pytest.raises(ValueError, match="already holds"):
        cache.compress_prefill(0, k, v, sel, budget)
    cache.reset()
    assert cache.seq_len == 0 and cache.n_seen == 0 and cache.nbytes() == 0


# ------------------------------------------------------------------------------------------------- driver
def tiny_model(**kw):
    base = dict(vocab_size=61, n_layer=2, n_head=2, d_model=16, block_size=64, bias=True, attention="mha")
    base.update(kw)
    torch.manual_seed(3)
    model = GPT(GPTConfig(**base)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def test_full_budget_reproduces_the_model_for_every_selector():
    model = tiny_model()
    idx = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(idx)
    p = 24
    for sel in selectors():
        res = run_token_selection(model, idx, sel, budget=p, prompt_len=p, return_logits=True)
        torch.testing.assert_close(res.logits, full[:, p - 1:-1], atol=1e-5, rtol=0)
        nll = torch.nn.functional.cross_entropy(full[:, p - 1:-1].reshape(-1, 61), idx[:, p:].reshape(-1))
        assert abs(res.nll - nll.item()) < 1e-5 and res.n_scored == 2 * (40 - p)
        assert res.n_keep == p and res.cache.seq_len == 40 - 1 and res.cache.n_seen == 40 - 1
        assert res.cache_nbytes == res.cache.nbytes() == subset_bytes(2, 2, 2, 8, 8, 39)


def test_compressed_decode_runs_end_to_end_and_chunking_is_exact():
    model = tiny_model()
    idx = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(5))
    p, budget = 32, 12
    for sel in selectors():
        sel.reseed(0)
        whole = run_token_selection(model, idx, sel, budget=budget, prompt_len=p, return_logits=True)
        sel.reseed(0)
        steps = run_token_selection(model, idx, sel, budget=budget, prompt_len=p, return_logits=True,
                                    decode_chunk=1)
        assert math.isfinite(whole.ppl) and whole.n_keep == budget
        torch.testing.assert_close(whole.logits, steps.logits, atol=1e-5, rtol=0)
        # the first continuation token comes from the exact prefill
        with torch.no_grad():
            torch.testing.assert_close(whole.logits[:, 0], model(idx[:, :p])[:, -1], atol=1e-5, rtol=0)
        held = budget + (48 - 1 - p)
        assert whole.cache.seq_len == held
        assert whole.cache_nbytes == subset_bytes(2, 2, 2, 8, 8, held) < whole.full_nbytes
    with pytest.raises(ValueError, match="MHA"):
        run_token_selection(GPT(GPTConfig(vocab_size=61, n_layer=1, n_head=2, d_model=16, block_size=64,
                                          attention="mla", d_latent=8)), idx, selectors()[0], budget)
