"""Tests for kvsplice.select.kvzip.KVzipSelection: the reconstruction scores equal the attention the model itself
pays to the context while reading "repeat" + context after it (transformers' eager attentions), in both doors;
the full budget is lossless; a budget keeps the top-scored tokens and the bytes equal the closed form."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import tiny_family  # noqa: E402

from kvsplice.decode.decoder import Decoder  # noqa: E402
from kvsplice.decode.dense import DenseKV  # noqa: E402
from kvsplice.hf.base import KVSpliceHFCache  # noqa: E402
from kvsplice.select.kvzip import KVzipSelection  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_family("llama", n_layer=3)


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _reference_scores(model, ctx, recon) -> list[torch.Tensor]:
    """Max attention each context token receives from the reconstruction queries, per layer and KV head, from
    transformers' own eager attention over ``ctx + recon``."""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            att = model(torch.cat([ctx, recon], 1), output_attentions=True).attentions  # L × (1, Hq, T+Tr, T+Tr)
    finally:
        model.config._attn_implementation = impl
    t, hkv = ctx.shape[1], model.config.num_key_value_heads
    out = []
    for a in att:
        a = a[:, :, t:, :t]  # (1, Hq, Tr, T)
        out.append(a.reshape(1, hkv, -1, a.shape[2], t).amax(dim=(2, 3)))  # (1, Hkv, T)
    return out


def test_kvzip_scores_are_the_models_reconstruction_attention(model) -> None:
    ctx, recon = _ids(0, 40), _ids(1, 50)
    ref = _reference_scores(model, ctx, recon)
    method = KVzipSelection(10, recon_ids=recon, chunk=16)
    dec = Decoder(model, method)
    dec(ctx, dec.new_cache(1))
    hf = KVSpliceHFCache(model, method)
    with torch.no_grad():
        model(ctx, past_key_values=hf, use_cache=True)
    for layer, r in enumerate(ref):
        torch.testing.assert_close(dec.method.layer_scores[layer], r, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(hf.method.layer_scores[layer], r, atol=1e-5, rtol=1e-4)


def test_kvzip_full_budget_is_lossless_and_budget_keeps_top_tokens(model) -> None:
    ctx, recon, nxt = _ids(2, 30), _ids(3, 35), _ids(4, 5)
    full = Decoder(model)
    c = full.new_cache(1)
    full(ctx, c)
    want = full(nxt, c)
    dec = Decoder(model, KVzipSelection(30, recon_ids=recon))
    c2 = dec.new_cache(1)
    dec(ctx, c2)
    torch.testing.assert_close(dec(nxt, c2), want, atol=1e-5, rtol=1e-5)
    dec = Decoder(model, KVzipSelection(8, recon_ids=recon, store=DenseKV(cache_quant="int8")))
    c3 = dec.new_cache(1)
    dec(ctx, c3)
    assert c3.seq_len == 8 and c3.nbytes() == dec.formula_nbytes(c3)
    last = dec.method.layer_scores[len(dec.method.layer_scores) - 1][0]  # (Hkv, T): the last layer's scores
    idx, _ = dec.method.selector.select(torch.zeros(last.shape[0], 30, 4), torch.zeros(last.shape[0], 30, 4), 8)
    assert torch.equal(idx, last.topk(8, dim=-1).indices.sort(dim=-1).values)  # the top-scored tokens are kept


def test_kvzip_refuses_bad_input(model) -> None:
    with pytest.raises(ValueError, match="recon_ids"):
        KVzipSelection(4, recon_ids=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="sliding-window"):
        Decoder(tiny_family("mistral", window=8), KVzipSelection(4, recon_ids=_ids(0, 5)))
