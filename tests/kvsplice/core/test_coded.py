"""Tests for kvsplice.core.coded: a decode step's attention straight from quantised rows equals the
dequantise-then-attend reference — per row kind (int8 rows, int4 rows, KIVI's per-channel key groups at 4 and 8
bits, a pool shared by the heads with each head's own entries, masks and log-weights), and through the methods that
use it (``kivi4``, ``int8``, ``int4h``, ``k8v4h``, the pooled KVzip stacks of the planner's picks): one token at a
time (the coded path) vs a teacher-forced chunk (the dense path), in both doors, batch 1 and 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tiny_models import tiny_family  # noqa: E402
from test_kvzip import _ids, _Tok  # noqa: E402

from kvsplice.core.attention import weighted_attend  # noqa: E402
from kvsplice.core.coded import ChannelGroupKeys, Rows, Segment, coded_attend, seen_bias  # noqa: E402
from kvsplice.core.build import build_method  # noqa: E402
from kvsplice.decode.decoder import Decoder  # noqa: E402
from kvsplice.hf.base import KVSpliceHFCache  # noqa: E402
from models.quant import dequantize, pack_codes, quantize, quantize_int8  # noqa: E402

B, H, G_Q, D = 2, 3, 3, 64


def _int8(x):
    c, s = quantize_int8(x)
    return Rows("int8", c, s), c.float() * s.float()


def _int4(x, group=32):
    c, s, m = quantize(x.unflatten(-1, (x.shape[-1] // group, group)), -1, 4)
    return Rows("int4", pack_codes(c.flatten(-2), 4), s[..., 0], m[..., 0]), dequantize(c, s, m, torch.float32).flatten(-2)


@pytest.mark.parametrize("keys,values", [("int8", "int4"), ("int4", "int4"), ("int8", "int8"), ("float", "int4"),
                                         ("kivi4", "int4"), ("kivi8", "int8")])
def test_coded_rows_equal_dequantised_attention(keys, values) -> None:
    g = torch.Generator().manual_seed(0)
    n, nr = 96, 5
    k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    kr, vr = torch.randn(B, H, nr, D, generator=g), torch.randn(B, H, nr, D, generator=g)
    q = torch.randn(B, H * G_Q, 1, D, generator=g)
    if keys.startswith("kivi"):
        bits = int(keys[4:])
        c, s, m = quantize(k.reshape(B, H, n // 32, 32, D), 3, bits)
        ks = ChannelGroupKeys(pack_codes(c.reshape(B, H, n, D), bits), s[:, :, :, 0], m[:, :, :, 0], bits)
        kd = dequantize(c, s, m, torch.float32).reshape(B, H, n, D)
    else:
        ks, kd = {"int8": _int8, "int4": _int4, "float": lambda x: (Rows("float", x), x)}[keys](k)
    vs, vd = {"int8": _int8, "int4": _int4}[values](v)
    logw = torch.randn(B, H, n + nr, generator=g)
    logw[0, 1, :7] = float("-inf")  # hidden keys
    ref = weighted_attend(q, torch.cat([kd, kr], 2), torch.cat([vd, vr], 2), logw, scale=0.125)
    got = coded_attend(q, [Segment(ks, vs, logw[..., :n]), Segment(Rows("float", kr), Rows("float", vr), logw[..., n:])],
                       scale=0.125)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # fp32 sums in another order


def test_shared_pool_scores_every_head_once_with_its_own_entries() -> None:
    g = torch.Generator().manual_seed(1)
    n, nr = 40, 4
    pk, pv = torch.randn(B, 1, n, D, generator=g), torch.randn(B, 1, n, D, generator=g)
    kr, vr = torch.randn(B, H, nr, D, generator=g), torch.randn(B, H, nr, D, generator=g)
    q = torch.randn(B, H * G_Q, 1, D, generator=g)
    bias = torch.full((B, H, n), float("-inf"))
    for h in range(H):  # overlapping ranges: the bias alone decides what a head sees
        bias[:, h, h * 12:h * 12 + 16] = 0.0
    ks, kd = _int8(pk)
    vs, vd = _int4(pv)
    ref = weighted_attend(q, torch.cat([kd.expand(B, H, n, D), kr], 2), torch.cat([vd.expand(B, H, n, D), vr], 2),
                          torch.cat([bias, torch.zeros(B, H, nr)], -1), scale=0.125)
    got = coded_attend(q, [Segment(ks, vs, bias, shared=True), Segment(Rows("float", kr), Rows("float", vr))],
                       scale=0.125)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # fp32 sums in another order
    mask = torch.ones(B, 1, 1, nr, dtype=torch.bool)
    mask[1, ..., 0] = False  # a padded column of sequence 1
    b = seen_bias(mask, B, H, nr)
    assert b.shape == (B, H, nr) and torch.isinf(b[1, :, 0]).all() and (b[0] == 0).all()
    with pytest.raises(ValueError, match="one query per head"):
        coded_attend(torch.zeros(B, H * G_Q, 2, D), [Segment(Rows("float", kr), Rows("float", vr))], scale=1.0)


@pytest.fixture(scope="module")
def model():
    return tiny_family("llama", n_layer=3)


SPECS = ["kivi4(group=8,residual=16)", "int8", "int4h", "k8v4h",
         "select:kvzip(mix=observed_attention,share=0.1,heads=pooled,layers=50%-67%,decoded=int8)@x1.69+k8v4h",
         "select:kvzip(mix=observed_attention,share=0.1,heads=pooled,decoded=int8)@x3.38+k8v4h",
         "select:observed_attention@x2+k8v4h"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_steps_equal_the_dense_chunk_in_both_doors(model, spec, batch) -> None:
    """Steps of one token take the coded path, a teacher-forced chunk the dequantise-then-attend one; a 50-token
    prompt + 4 tokens crosses no KIVI flush (residual 16, groups of 8: 32 quantised tokens throughout)."""
    ctx, rep, nxt = _ids(30, 50).expand(batch, -1), _ids(31, 4), _ids(32, 4).expand(batch, -1)
    build = lambda: build_method(spec, prompt_len=50, prompt_ids=ctx[:1], tokenizer=_Tok(rep))  # noqa: E731
    dec = Decoder(model, build())
    ref_cache = dec.new_cache(batch)
    dec(ctx, ref_cache)
    ref = dec(nxt, ref_cache)  # (B, 4, V): one call of 4 queries
    cache = dec.new_cache(batch)
    dec(ctx, cache)
    got = torch.cat([dec(nxt[:, i:i + 1], cache) for i in range(4)], 1)  # one token at a time
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert cache.nbytes() == ref_cache.nbytes() == dec.formula_nbytes(cache)  # the same bytes, as the formula says
    hf = KVSpliceHFCache(model, build())
    with torch.no_grad():
        model(ctx, past_key_values=hf, use_cache=True)
        out = torch.cat([model(nxt[:, i:i + 1], past_key_values=hf, use_cache=True).logits for i in range(4)], 1)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert hf.nbytes() == hf.formula_nbytes()
