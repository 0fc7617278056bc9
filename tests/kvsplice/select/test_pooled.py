"""Tests for kvsplice.select.pooled (``kvzip(heads=pooled)``): a layer's KV heads keep the ``Hkv · budget`` best of
their scores together; decode over the pooled cache equals attention over every prompt token with the non-kept
ones masked (a plain subset cache of the whole prompt, log-weights ``-inf``), in both doors; the full budget is
the full cache; bytes equal the closed form with exact storage; stores that are not rows are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tiny_models import tiny_family  # noqa: E402
from test_kvzip import _ids, _Tok  # noqa: E402

from kvsplice.core.build import build_method  # noqa: E402
from kvsplice.decode.decoder import Decoder  # noqa: E402
from kvsplice.hf.base import KVSpliceHFCache  # noqa: E402
from kvsplice.select.method import TokenSelection  # noqa: E402
from kvsplice.select.pooled import PooledSubsetCache, own_tokens, pool_tokens, pooled_bias  # noqa: E402
from kvsplice.select.pooled_layers import depth_band  # noqa: E402
from kvsplice.select.selectors import TokenSelector  # noqa: E402
from models.quant import int4_row_bytes  # noqa: E402
from models.stream_cache import KVCache  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_family("llama", n_layer=3)


def test_pool_tokens_draws_from_all_heads_and_bias_marks_each_heads_own() -> None:
    scores = torch.tensor([[[0.9, 0.8, 0.7, 0.6],    # head 0 spreads: it wins three of the four slots
                            [0.1, 0.0, 0.95, 0.2]]])  # head 1 looks at one token
    flat = pool_tokens(scores, 2)  # (1, 4): 2 per head on average
    assert flat.tolist() == [[0, 1, 2, 6]]  # head 0: tokens 0, 1, 2; head 1: token 2 (= 1·4 + 2)
    assert own_tokens(scores, 2).tolist() == [[0, 1, 6, 7]]  # a layer that does not pool: 2 each
    bias = pooled_bias(torch.tensor([[3, 1]]), 4, torch.float32)  # (1, 2, 4)
    assert (bias[0, 0] == 0).tolist() == [True, True, True, False]
    assert (bias[0, 1] == 0).tolist() == [False, False, False, True] and bias[0, 1, 0] == float("-inf")


class _Masked(TokenSelector):
    """Keeps every prompt token; log-weight 0 on those in ``keep[layer] (B·Hkv, T)``, ``-inf`` elsewhere (layers in
    call order)."""

    def __init__(self, keep: list[torch.Tensor]) -> None:
        super().__init__(0)
        self.keep, self.calls = keep, 0

    def select(self, k, v, budget, *, q=None, scale=None):  # every token, whatever the budget
        mask = self.keep[self.calls]
        self.calls += 1
        idx = torch.arange(k.shape[1]).expand(k.shape[0], -1)  # (B·Hkv, T): all of them, in order
        return idx, torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("spec", ["select:kvzip(heads=pooled)@x3", "select:kvzip(heads=pooled)@x2.5+int8",
                                  "select:kvzip(heads=pooled)@x2.5+int4h", "select:kvzip(heads=pooled)@x2.5+k8v4h",
                                  "select:kvzip(heads=pooled,layers=1-2)@x3",
                                  "select:kvzip(heads=pooled,layers=34%-100%)@x3",
                                  "select:kvzip(heads=pooled,mix=observed_attention,share=0.2)@x3"])
def test_pooled_decode_is_attention_with_the_dropped_entries_masked(model, spec) -> None:
    ctx, rep, nxt = _ids(20, 36), _ids(21, 4), _ids(22, 5)
    method = build_method(spec, prompt_ids=ctx, tokenizer=_Tok(rep))
    dec = Decoder(model, method)
    cache = dec.new_cache(1, capacity=method.capacity(36, 6))
    dec(ctx, cache)
    assert isinstance(cache, PooledSubsetCache) and cache.position == 36 and cache.seq_len == method.budget
    counts = torch.stack([c[0] for c in cache.counts])  # (L, Hkv): the heads' shares differ somewhere
    assert (counts.sum(-1) == 2 * method.budget).all() and (counts != method.budget).any()
    got = dec(nxt, cache)  # (1, 5, V)
    assert cache.nbytes() == dec.formula_nbytes(cache) == cache.storage_nbytes()  # exact capacity: no slack
    whole = Decoder(model)
    wc = whole.new_cache(1)
    whole(ctx, wc)
    keep = []  # (Hkv, T) per layer: which prompt entries each head owns, read back from the pool's keys
    store = dec.method.store
    for layer, c in enumerate(cache.counts):
        kept, owned, start = cache.pooled.get(layer)["k"][0, 0], torch.zeros(2, 36, dtype=torch.bool), 0  # (N, D)
        k = wc.get(layer)["k"]  # (1, Hkv, T, D): every prompt key, held as the store holds a row (rotated, quantised)
        rows = KVCache(1, 2, k.shape[-1], 1, quant=store.cache_quant).append(0, k=store.rotated(k), v=k)["k"][0]
        for h, n in enumerate(c[0].tolist()):  # head by head
            pos = torch.cdist(kept[start:start + n].float(), rows[h]).argmin(-1)  # (n,) tokens
            owned[h, pos] = True
            start += n
        assert owned.sum(-1).tolist() == c[0].tolist()  # no token twice in a head
        if "mix" not in spec:  # the best Hkv · budget of the layer's reconstruction scores (or each head's own)
            pools = "layers" not in spec or layer >= 1
            best = (pool_tokens if pools else own_tokens)(dec.method.layer_scores[layer], method.budget)[0]
            assert torch.equal(owned.view(-1).nonzero().flatten(), best)
            assert pools or c[0].tolist() == [method.budget] * 2
        keep.append(owned)
    ref = Decoder(model, TokenSelection(_Masked(keep), 36, store=method.store))
    rc = ref.new_cache(1)
    ref(ctx, rc)
    torch.testing.assert_close(got, ref(nxt, rc), atol=1e-4, rtol=1e-4)
    hf = KVSpliceHFCache(model, build_method(spec, prompt_ids=ctx, tokenizer=_Tok(rep)))
    with torch.no_grad():
        model(ctx, past_key_values=hf, use_cache=True)
        out = model(nxt, past_key_values=hf, use_cache=True).logits  # the transformers door
    torch.testing.assert_close(out, got, atol=1e-4, rtol=1e-4)
    assert hf.nbytes() == hf.formula_nbytes()


def test_pooled_full_budget_is_the_full_cache_and_bad_stores_are_refused(model) -> None:
    ctx, rep, nxt = _ids(23, 24), _ids(24, 3), _ids(25, 4)
    full = Decoder(model)
    c = full.new_cache(1)
    full(ctx, c)
    dec = Decoder(model, build_method("select:kvzip(heads=pooled)@1.0", prompt_ids=ctx, tokenizer=_Tok(rep)))
    pc = dec.new_cache(1)
    dec(ctx, pc)
    torch.testing.assert_close(dec(nxt, pc), full(nxt, c), atol=1e-5, rtol=1e-5)
    pc.truncate(pc.seq_len - 2)  # roll back two decoded tokens: positions follow
    assert pc.position == 24 + 2 and pc.seq_len == 24 + 2
    with pytest.raises(ValueError, match="the pooled prompt holds 24 tokens per head"):
        pc.truncate(10)
    with pytest.raises(ValueError, match=r"its store must be dense \(full precision, int8 or int4 rows\)"):
        Decoder(model, build_method("select:kvzip(heads=pooled)@x2+kivi(bits=4,group=8,residual=8)", prompt_ids=ctx, tokenizer=_Tok(rep)))
    with pytest.raises(ValueError, match="the model has layers 0-2"):
        Decoder(model, build_method("select:kvzip(heads=pooled,layers=2-3)@x2", prompt_ids=ctx, tokenizer=_Tok(rep)))
    with pytest.raises(ValueError, match="holds none of the model's 3 layers"):
        Decoder(model, build_method("select:kvzip(heads=pooled,layers=0%-10%)@x2", prompt_ids=ctx, tokenizer=_Tok(rep)))
    for bad, words in (("heads=union,layers=1", "it needs heads=pooled"), ("heads=pooled,layers=2-1", "range A-B"),
                       ("heads=pooled,layers=50%-40%", "P%-Q% with 0 <= P < Q <= 100"),
                       ("heads=pooled,layers=50%-101%", "P%-Q%"), ("heads=pooled,layers=a%-9%", "P%-Q%"),
                       ("heads=pooled,layers=50%-7", "a band of the depth P%-Q%")):
        with pytest.raises(ValueError, match=words):
            build_method(f"select:kvzip({bad})@x2", prompt_ids=ctx, tokenizer=_Tok(rep))
    with pytest.raises(TypeError, match="needs a PooledSubsetCache"):
        dec(nxt, full.new_cache(1))


def test_depth_band_maps_percent_of_the_depth_to_layers() -> None:
    assert depth_band((50.0, 67.0), 30) == (15, 19)  # SmolLM2-135M: the band the planner tries
    assert depth_band((33.0, 67.0), 30) == (10, 19)
    assert depth_band((0.0, 100.0), 16) == (0, 15) and depth_band((50.0, 100.0), 3) == (1, 2)  # middles 50, 83 %
    assert depth_band((50.0, 67.0), 5) == (2, 2) and depth_band((50.0, 100.0), 7) == (3, 6)
    with pytest.raises(ValueError, match="holds none of the model's 4 layers"):
        depth_band((0.0, 10.0), 4)


def _decode(model, spec, ctx, rep, nxt):
    """Prefill ``ctx`` and decode ``nxt`` over ``spec``'s pooled cache with exact capacity → (logits, cache, dec)."""
    method = build_method(spec, prompt_ids=ctx, tokenizer=_Tok(rep))
    dec = Decoder(model, method)
    cache = dec.new_cache(1, capacity=method.capacity(ctx.shape[1], nxt.shape[1] + 1))  # nxt: every token fed
    dec(ctx, cache)
    return dec(nxt, cache), cache, dec


def test_pooled_decoded_tokens_are_held_their_own_way(model) -> None:
    ctx, rep, nxt = _ids(26, 36), _ids(27, 4), _ids(28, 6)
    base = "select:kvzip(heads=pooled{})@x2.5{}"
    # a store whose rows are the decoded store's: the same cache, the same answer
    for store, decoded in (("+int8", "int8"), ("", "full")):
        a, _, _ = _decode(model, base.format("", store), ctx, rep, nxt)
        b, _, _ = _decode(model, base.format(f",decoded={decoded}", store), ctx, rep, nxt)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    full, fc, _ = _decode(model, base.format(",decoded=full", "+k8v4h"), ctx, rep, nxt)
    same, sc, _ = _decode(model, base.format("", "+k8v4h"), ctx, rep, nxt)
    got, cache, dec = _decode(model, base.format(",decoded=int8", "+k8v4h"), ctx, rep, nxt)
    for c in (fc, sc):  # the prompt's pool is chosen and held the same way whatever holds the decoded tokens
        for layer in range(3):
            assert torch.equal(c.counts[layer], cache.counts[layer])
            assert torch.equal(c.pooled.get(layer)["v"], cache.pooled.get(layer)["v"])
    assert cache.recent.quant == "int8" and sc.recent.quant == {"k": "int8", "v": "int4"} and fc.recent.quant is None
    # int8 values of the decoded tokens sit nearer the full-precision ones than int4 values do
    assert (got - full).abs().max() < (same - full).abs().max()
    assert cache.nbytes() == dec.formula_nbytes(cache) == cache.storage_nbytes()  # exact capacity: no slack
    d = cache.recent.get(0)["k"].shape[-1]  # head size
    rows = 3 * 2 * 6  # layers · KV heads · decoded tokens: one value row each, int8 instead of int4
    assert cache.nbytes() - sc.nbytes() == rows * ((d + 2) - int4_row_bytes(d))
    hf = KVSpliceHFCache(model, build_method(base.format(",decoded=int8", "+k8v4h"), prompt_ids=ctx,
                                             tokenizer=_Tok(rep)))
    with torch.no_grad():
        model(ctx, past_key_values=hf, use_cache=True)
        out = model(nxt, past_key_values=hf, use_cache=True).logits  # the transformers door
    torch.testing.assert_close(out, got, atol=1e-4, rtol=1e-4)
    assert hf.nbytes() == hf.formula_nbytes()
    for bad, words in (("heads=own,decoded=int8", "decoded= .* needs heads=pooled"),
                       ("heads=pooled,decoded=int4", "decoded must be one of")):
        with pytest.raises(ValueError, match=words):
            build_method(f"select:kvzip({bad})@x2", prompt_ids=ctx, tokenizer=_Tok(rep))
