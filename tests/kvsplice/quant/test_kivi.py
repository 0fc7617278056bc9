"""KIVI-style low-bit storage (``kvsplice.quant``): the packing is exact, the rounding error is at most half a step,
a window covering every token is lossless, measured bytes == formula at every length, both doors agree — alone
and holding a token selection — and fewer bits cost more error."""

from __future__ import annotations

import pytest
import torch

from kvsplice.decode import Decoder, DenseKV
from kvsplice.quant import KIVI, kivi_bytes
from kvsplice.report.memory import measure_cache
from kvsplice.select.method import TokenSelection
from kvsplice.select.selectors import make_selector
from models.quant import dequantize, pack_codes, quantize, unpack_codes
from test_stack import assert_same, both_doors, ids_of, tiny


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_round_trips_and_rounding_is_half_a_step(bits):
    x = torch.randn(2, 3, 4, 8, 16) * torch.linspace(0.1, 5, 16)  # groups of 8 along dim 3, channels of any scale
    c, s, m = quantize(x, 3, bits)
    assert c.dtype == torch.uint8 and int(c.max()) <= 2 ** bits - 1
    flat = c.reshape(2, 3, 32, 16)
    assert torch.equal(unpack_codes(pack_codes(flat, bits), bits), flat)
    assert pack_codes(flat, bits).shape[-1] == 16 * bits // 8
    err = (dequantize(c, s, m, torch.float32) - x).abs()
    assert bool((err <= s.float() / 2 + 1e-3 * s.float() + 1e-6).all())


def test_a_window_over_every_token_is_lossless_in_both_doors():
    model = tiny("llama")
    ids = ids_of(2, 14, 1)
    runs = both_doors(model, KIVI(bits=2, group=8, residual=64), ids[:, :10], [ids[:, 10:11], ids[:, 11:14]])
    with torch.no_grad():
        want = model(ids).logits
    for door, (logits, _) in runs.items():
        torch.testing.assert_close(torch.cat(logits, 1), want, atol=1e-4, rtol=0, msg=lambda m: door + m)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bytes_are_the_formula_at_every_length_and_the_doors_agree(family):
    model = tiny(family)
    ids = ids_of(2, 40, 2)
    method = KIVI(bits=4, group=8, residual=4)  # head_dim 8: one group per row of values
    steps = [ids[:, t:t + 1] for t in range(19, 27)] + [ids[:, 27:40]]
    runs = both_doors(model, method, ids[:, :19], steps)
    assert_same(runs["decoder"][0], runs["hf"][0], atol=1e-4, what="decoder vs hf")
    for door, (_, cache) in runs.items():
        store = cache.method_cache if door == "hf" else cache
        assert store.seq_len == 40
        formula = cache.formula_nbytes() if door == "hf" else store.formula_nbytes()
        assert measure_cache(cache).live_bytes == cache.nbytes() == formula
    a = Decoder(model, method).method.adapter
    nq = 32  # 8·⌊(40 − 4)/8⌋ quantised tokens, 8 at full precision
    per_head = 2 * nq * 8 * 4 // 8 + 2 * (nq // 8) * 8 * 2 + 2 * nq * 1 * 2 + 2 * 8 * 8 * 4
    assert kivi_bytes(a.n_layer, a.n_kv_head, 8, 2, 40, bits=4, group=8, residual=4, dtype=torch.float32) \
        == a.n_layer * a.n_kv_head * 2 * per_head


def test_fewer_bits_cost_more_and_eight_bits_are_close():
    model = tiny("llama")
    ids = ids_of(1, 48, 3)
    with torch.no_grad():
        want = model(ids).logits
    errs = {}
    for bits in (2, 4, 8):
        dec = Decoder(model, KIVI(bits=bits, group=8, residual=0))
        cache = dec.new_cache(1)
        got = torch.cat([dec(ids[:, s:s + 8], cache) for s in range(0, 48, 8)], 1)
        errs[bits] = float((got - want).abs().max())
    assert errs[8] < errs[4] < errs[2] and errs[8] < 0.05 * errs[2], errs


@pytest.mark.parametrize("selector", ["knorm", "snapkv", "observed_attention"])
def test_kivi_holds_a_token_selection_in_both_doors(selector):
    model = tiny("llama")
    ids = ids_of(2, 30, 4)
    kw = {"snapkv": dict(window=4, kernel=3)}.get(selector, {})
    method = TokenSelection(make_selector(selector, **kw), 12, store=KIVI(bits=4, group=8, residual=2))
    runs = both_doors(model, method, ids[:, :24], [ids[:, 24:25], ids[:, 25:30]])
    assert_same(runs["decoder"][0], runs["hf"][0], atol=1e-4, what="decoder vs hf")
    _, cache = runs["hf"]
    assert cache.seq_len == 12 + 6 and measure_cache(cache).live_bytes == cache.formula_nbytes()
    dense = both_doors(model, TokenSelection(make_selector(selector, **kw), 12, store=DenseKV()), ids[:, :24],
                       [ids[:, 24:25], ids[:, 25:30]])
    assert cache.nbytes() < dense["hf"][1].nbytes()


def test_truncate_drops_only_full_precision_tokens():
    model = tiny("llama")
    dec = Decoder(model, KIVI(bits=4, group=8, residual=8))
    cache = dec.new_cache(1)
    ids = ids_of(1, 30, 5)
    dec(ids[:, :20], cache)  # 8 quantised, 12 at full precision
    before = dec(ids[:, 20:21], cache)
    cache.truncate(20)
    assert cache.seq_len == cache.position == 20
    torch.testing.assert_close(dec(ids[:, 20:21], cache), before)
    with pytest.raises(ValueError, match="full-precision"):
        cache.truncate(4)


def test_rotated_kivi_is_exact_unquantised_same_bytes_and_tames_an_outlier_channel():
    from kvsplice.quant.rotated import RotatedKIVI, hadamard

    h = hadamard(8)
    torch.testing.assert_close(h @ h.T, torch.eye(8))
    model = tiny("llama")  # head_dim 8
    ids = ids_of(2, 14, 1)
    runs = both_doors(model, RotatedKIVI(bits=2, group=8, residual=64), ids[:, :10], [ids[:, 10:11], ids[:, 11:14]])
    with torch.no_grad():
        want = model(ids).logits
    for door, (logits, cache) in runs.items():  # nothing quantised: the rotation alone is exact
        torch.testing.assert_close(torch.cat(logits, 1), want, atol=1e-4, rtol=0, msg=lambda m: door + m)
    runs = both_doors(model, RotatedKIVI(bits=4, group=8, residual=4), ids[:, :10], [ids[:, 10:14]])
    assert_same(runs["decoder"][0], runs["hf"][0], atol=1e-4, what="decoder vs hf")
    for door, (_, cache) in runs.items():
        assert measure_cache(cache).live_bytes == cache.nbytes()
    plain = KIVI(bits=4, group=8, residual=4)
    dec = Decoder(model, RotatedKIVI(bits=4, group=8, residual=4))
    c = dec.new_cache(2)
    dec(ids, c)
    assert c.nbytes() == dec.formula_nbytes(c) == Decoder(model, plain).method.bytes_formula(2, 14, c.dtype)
    # an outlier channel: per-token value groups lose the small channels at 2 bits; rotated, they hold
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 64, 8, generator=g)
    x[..., 3] *= 40.0
    c, s, m = quantize(x, 3, 2)
    plain_err = (dequantize(c, s, m, torch.float32) - x)[..., [0, 1, 2, 4, 5, 6, 7]].abs().mean()
    xr = x @ h
    c, s, m = quantize(xr, 3, 2)
    rot_err = ((dequantize(c, s, m, torch.float32) @ h.T) - x)[..., [0, 1, 2, 4, 5, 6, 7]].abs().mean()
    assert rot_err < plain_err, (rot_err, plain_err)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dense_rows_rotated_are_exact_and_int4_rows_are_their_formula_in_both_doors(family):
    """``DenseKV(rotate=True)``: the Hadamard frame alone changes nothing (the model's logits, both doors);
    ``int4`` / ``int4h`` rows and int8 keys with int4 values (``k8v4h``): the doors agree, bytes == formula == storage (D/2 code bytes + an fp16 scale and
    minimum per group a row), close to the model but not equal (the rows really are 4-bit), and alone or holding a
    token selection."""
    from models.quant import int4_row_bytes

    model = tiny(family)  # head_dim 8: one group per row
    ids = ids_of(2, 14, 1)
    with torch.no_grad():
        want = model(ids).logits
    runs = both_doors(model, DenseKV(rotate=True), ids[:, :10], [ids[:, 10:11], ids[:, 11:14]])
    for door, (logits, _) in runs.items():
        torch.testing.assert_close(torch.cat(logits, 1), want, atol=1e-4, rtol=0, msg=lambda m: door + m)
    for method in (DenseKV(cache_quant="int4"), DenseKV(cache_quant="int4", rotate=True),
                   DenseKV(cache_quant="int8", value_quant="int4", rotate=True),
                   TokenSelection(make_selector("snapkv"), 6, store=DenseKV(cache_quant="int4", rotate=True))):
        runs = both_doors(model, method, ids[:, :10], [ids[:, 10:11], ids[:, 11:14]])
        assert_same(runs["decoder"][0], runs["hf"][0], atol=1e-4, what=f"{method!r} decoder vs hf")
        for door, (logits, cache) in runs.items():
            assert measure_cache(cache).live_bytes == cache.nbytes()
        dec = Decoder(model, method)
        c = dec.new_cache(2)
        got = dec(ids, c)
        held = 14 if isinstance(method, DenseKV) else 6  # one 14-token prefill kept to 6 per head
        rows = 2 * held * (2 if family == "llama" else 4) * 2  # layers · tokens · KV heads · batch: a k and a v row
        weights = 0 if isinstance(method, DenseKV) else 2 * held * 2 * (2 if family == "llama" else 4) * 4
        k_row = 8 + 2 if getattr(method, "value_quant", None) else int4_row_bytes(8)  # int8 keys: a byte + a scale
        assert c.nbytes() == dec.formula_nbytes(c) == rows * (k_row + int4_row_bytes(8)) + weights
        if isinstance(method, DenseKV):
            assert not torch.equal(got, want)
            torch.testing.assert_close(got.softmax(-1), want.softmax(-1), atol=0.1, rtol=0)
    with pytest.raises(ValueError, match="rotate must be true or false"):
        DenseKV(rotate="yes")
    with pytest.raises(ValueError, match="set cache_quant too"):
        DenseKV(value_quant="int4")
