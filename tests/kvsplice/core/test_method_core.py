"""The method core: each method's attention is one function (``CompressionMethod.attend``) that both doors — the
package's ``Decoder`` and the ``transformers.Cache`` (HF door) — call, with the same numbers; binding never changes
the method; a selector that scores tokens by attention gets the prefill queries in both doors."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvsplice.core.method import CompressionMethod
from kvsplice.decode import Decoder, DenseKV
from kvsplice.hf import KVSpliceHFCache
from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.method import LowRank
from kvsplice.online.chunked import ChunkedCache
from kvsplice.online.method import OnlineFD
from kvsplice.select.method import TokenSelection
from kvsplice.select.selectors import StreamingLLMSelector, TokenSelector, make_selector
from models.cache import Cache
from tiny_models import orthonormal_bases, sharpen

V = 53


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0)
    return sharpen(transformers.LlamaForCausalLM(cfg), seed=123 + seed)


def bases(rank: int, rope: str, seed: int = 0) -> KVBases:
    return orthonormal_bases(2, 2, 8, rank, rope, seed=seed)


def methods() -> dict[str, CompressionMethod]:
    """Lossy settings of every method (a real compression, so a wrong path would show)."""
    return {"dense-int8": DenseKV(cache_quant="int8"),
            "lowrank-post": LowRank(bases(4, "post")), "lowrank-pre": LowRank(bases(4, "pre")),
            "lowrank-naive": LowRank(bases(4, "pre"), impl="naive"),
            "lowrank-int8": LowRank(bases(4, "post"), cache_quant="int8"),
            "select": TokenSelection(make_selector("uniform", n_sink=1, n_recent=2), 5),
            "fd-online": OnlineFD(rank_k=3, rank_v=3, warmup=2, max_chunk_len=4),
            "stack": TokenSelection(make_selector("balancekv", n_sink=1, n_recent=2, block_size=4), 6,
                                    store=LowRank(bases(4, "post"), cache_quant="int8"))}


def hf_logits(model, method, ids, nxt):
    cache = KVSpliceHFCache(model, method)
    with torch.no_grad():
        return [model(ids, past_key_values=cache).logits, model(nxt, past_key_values=cache).logits], cache


def decoder_logits(model, method, ids, nxt):
    dec = Decoder(model, method)
    cache = dec.new_cache(ids.shape[0])
    return [dec(ids, cache), dec(nxt, cache)], cache


def test_each_methods_attention_is_one_function_both_doors_call(monkeypatch):
    """Patch every method's ``attend`` with a counting wrapper: the Decoder and the HF door both go through it (for
    every layer, prefill and decode), and both doors give the same logits — there is no second implementation."""
    model = tiny_llama()
    ids = torch.randint(3, V, (1, 11), generator=torch.Generator().manual_seed(1))
    nxt = torch.tensor([[7]])
    for name, method in methods().items():
        calls: dict[str, int] = {}
        classes = {type(method)} | ({type(method.store)} if isinstance(method, TokenSelection) else set())
        with monkeypatch.context() as m:
            for cls in classes:
                def counted(self, *a, _orig=cls.attend, _cls=cls, **kw):
                    calls[_cls.__name__] = calls.get(_cls.__name__, 0) + 1
                    return _orig(self, *a, **kw)
                m.setattr(cls, "attend", counted)
            for door, run in (("decoder", decoder_logits), ("hf", hf_logits)):
                calls.clear()
                if isinstance(method, TokenSelection):
                    method.selector.reseed()  # the same random draws in both doors
                out, _ = run(model, method, ids, nxt)
                assert calls.get(type(method).__name__) == 2 * 2, (name, door, calls)  # 2 layers × (prefill + step)
                if isinstance(method, TokenSelection):  # decode attends through the storage method's function
                    assert calls.get(type(method.store).__name__) == 2, (name, door, calls)
                if door == "decoder":
                    want = out
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=lambda s: f"{name}: {s}")


def test_hf_door_does_not_touch_the_method_for_other_caches(monkeypatch):
    model = tiny_llama()
    ids = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(2))
    KVSpliceHFCache(model, LowRank(bases(4, "post")))  # switches the model to the "kvsplice" attention
    monkeypatch.setattr(LowRank, "attend", lambda *a, **kw: pytest.fail("LowRank.attend called for DynamicCache"))
    with torch.no_grad():
        model(ids, past_key_values=transformers.DynamicCache(config=model.config))


def test_bind_returns_a_prepared_copy_and_leaves_the_method_unbound():
    """One method instance serves two models (one per door and one per model): binding never mutates it."""
    m1, m2 = tiny_llama(0), tiny_llama(1)
    method = LowRank(bases(8, "pre"))
    d1, d2 = Decoder(m1, method), Decoder(m2, method)
    assert method.adapter is None and method.key_mode is None and not hasattr(method, "groups")
    assert d1.method is not method and d1.method.adapter.model is m1 and d2.method.adapter.model is m2
    ids = torch.randint(3, V, (1, 9), generator=torch.Generator().manual_seed(3))
    for model, dec in ((m1, d1), (m2, d2)):  # full rank pre-RoPE: each reproduces its own model
        with torch.no_grad():
            want = model(ids).logits
        torch.testing.assert_close(dec(ids, dec.new_cache(1)), want, atol=1e-4, rtol=0)
    with pytest.raises(RuntimeError, match="not bound"):
        method.new_cache(1, dtype=torch.float32, device=torch.device("cpu"))
    # the online method's cache is a models.cache.Cache (its chunks are not DecodeCache streams)
    dec = Decoder(m1, OnlineFD(rank_k=2))
    assert isinstance(dec.new_cache(1), ChunkedCache) and isinstance(dec.new_cache(1), Cache)


class _LastQuerySelector(TokenSelector):
    """A tiny attention-score selector (test only): keep the tokens the last prompt query of each KV head's query
    heads attends to most (summed over the group), log-weight 0."""

    name = "test-last-query"
    needs_queries = True
    seen: list = []

    def _select(self, k, v, budget, q=None, scale=None):
        h, t, d = k.shape
        self.seen.append((tuple(q.shape), scale))
        last = q.view(h, -1, t, d)[:, :, -1]  # (Hkv, g, d): each query head's last prompt query
        p = torch.softmax(last @ k.transpose(1, 2) * scale, dim=-1).sum(1)  # (Hkv, T)
        idx = p.topk(budget, dim=-1).indices.sort(dim=-1).values
        return idx, torch.zeros(h, budget)


def test_attention_score_selectors_get_the_prefill_queries_in_both_doors():
    model = tiny_llama()
    seqs = [torch.randint(3, V, (t,), generator=torch.Generator().manual_seed(t)) for t in (12, 8)]
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, 12 - len(s):], mask[i, 12 - len(s):] = s, 1
    sel = _LastQuerySelector()
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, past_key_values=KVSpliceHFCache(
            model, TokenSelection(sel, 4)), **kw)
    assert {s for s, _ in sel.seen} == {(2, 2 * 12, 8), (2, 2 * 8, 8)}  # per padded row: (Hkv, g·n_real, d)
    assert all(scale == pytest.approx(8 ** -0.5) for _, scale in sel.seen)
    for i, s in enumerate(seqs):  # a padded row decodes as it does alone, in either door
        dec = Decoder(model, TokenSelection(sel, 4)).generate(s[None], 5)[0, len(s):]
        assert torch.equal(batched[i, 12:], dec), i
    with pytest.raises(ValueError, match="needs the queries"):
        sel.select(torch.randn(2, 6, 8), torch.randn(2, 6, 8), 3)
    assert StreamingLLMSelector().needs_queries is False
