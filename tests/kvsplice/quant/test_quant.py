"""int8 caches: symmetric per-row absmax quantisation with fp16 scales for every stream kind (full K/V, MLA latent,
KVSplice latent, low-rank coefficients); measured bytes == formula == tensors; decode stays close to unquantised."""

import dataclasses
import math

import pytest
import torch
import transformers

from kvsplice.decode import Decoder, DenseKV, sequence_nll
from kvsplice.lowrank.bases import HeadBases, KVBases
from kvsplice.lowrank.method import LowRank
from kvsplice.report.memory import cache_bytes_formula, measure_cache
from kvsplice.select.cache import SubsetCache
from models import GPT, GPTConfig, preset
from models.quant import GroupRows, Int8Rows, dequantize_int8 as dequantize, quantize_int8, row_bytes
from models.stream_cache import KVCache, LatentCache
from tiny_models import sharpen

V = 61


def test_quantize_roundtrip_is_within_half_a_step():
    x = torch.randn(3, 5, 7, 16) * torch.logspace(-3, 3, 7)[None, None, :, None]  # rows of very different scales
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (3, 5, 7, 1)
    assert int(q.abs().max()) <= 127
    err = (dequantize(q, s, torch.float32) - x).abs()
    assert bool((err <= 0.5 * s.float() + 1e-7).all())  # rounding to the nearest step of the fp16 scale
    zero_q, zero_s = quantize_int8(torch.zeros(2, 4))
    assert torch.equal(dequantize(zero_q, zero_s, torch.float32), torch.zeros(2, 4))


@pytest.mark.parametrize("quantizer, d", [(Int8Rows(), 6), (GroupRows(4), 64), (GroupRows(4), 6),
                                          (GroupRows(2, 16), 32), (GroupRows(8, 8), 24)])
def test_a_quantiser_stores_its_parts_in_its_bytes_and_reads_them_back(quantizer, d):
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(1)) * 3
    parts = quantizer.quantize(x)
    assert {p: (t.shape[-1], t.dtype) for p, t in parts.items()} == quantizer.parts(d)
    assert sum(t[0, 0].numel() * t.element_size() for t in parts.values()) == quantizer.row_bytes(d)
    if quantizer.name in ("int8", "int4") and getattr(quantizer, "group", None) is None:  # a cache mode's quantiser
        assert row_bytes(quantizer.name, d, torch.float16) == quantizer.row_bytes(d)
    back = quantizer.dequantize(parts, d, torch.float32)
    step = {"int8": x.abs().amax(-1, keepdim=True) / 127}.get(quantizer.name)
    if step is None:  # groups: (max - min) / levels of each group
        g = quantizer.group_of(d)
        xg = x.unflatten(-1, (-1, g))
        step = ((xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) / (2 ** quantizer.bits - 1)).expand_as(xg)
        step = step.flatten(-2)
    assert ((back - x).abs() <= step / 2 * 1.01 + 1e-3).all()
    assert quantizer.dequantize(parts, d, torch.float32, out=torch.empty_like(x)).equal(back)


def test_group_rows_along_tokens_are_kivis_key_groups():
    q = GroupRows(4, 8)
    x = torch.randn(2, 3, 16, 10, generator=torch.Generator().manual_seed(2))  # (B, H, T, D): groups of 8 tokens
    parts = q.quantize_tokens(x)
    assert parts[""].shape == (2, 3, 16, 5) and parts[".scale"].shape == parts[".min"].shape == (2, 3, 2, 10)
    back = q.dequantize_tokens(parts, torch.float32)
    xg = x.unflatten(-2, (2, 8))  # (B, H, T/G, G, D)
    step = ((xg.amax(-2, keepdim=True) - xg.amin(-2, keepdim=True)) / 15).expand_as(xg).flatten(-3, -2)
    assert ((back - x).abs() <= step / 2 * 1.01 + 1e-3).all()
    assert not torch.equal(back, x)  # lossy: the test can tell


@pytest.mark.parametrize("attention,kw", [("mha", {}), ("mla", {"d_latent": 16}),
                                          ("mla", {"d_latent": 16, "kvsplice_keep": 0.5})])
def test_int8_cache_bytes_and_decode(attention, kw):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, attention=attention, **kw)
    model = sharpen(GPT(cfg), std=0.1)
    q_model = GPT(dataclasses.replace(cfg, cache_quant="int8")).eval()
    q_model.load_state_dict(model.state_dict())
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    cache = q_model.new_cache(2, capacity=24)
    assert cache.quant == "int8"
    got = torch.cat([q_model(ids[:, :16], cache=cache), q_model(ids[:, 16:], cache=cache)], dim=1)
    # bytes: measured tensors == nbytes == allocated storage == the formula (int8 rows + one fp16 scale per row)
    m = measure_cache(cache)
    formula = cache_bytes_formula(q_model.cfg, 24, "fp32", batch_size=2)
    assert m.live_bytes == cache.nbytes() == m.storage_bytes == formula == 2 * 24 * cache.bytes_per_token()
    assert set(m.dtypes) == {"int8", "float16"}
    full = cache_bytes_formula(cfg, 24, "fp32", batch_size=2)
    assert formula < full / 3  # 1 byte instead of 4, plus the scales
    # quality: close to the unquantised model, and not identical (the cache really is int8)
    want = model(ids)
    assert not torch.equal(got, want)
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1), atol=2e-2, rtol=0)


def test_kvsplice90_int8_is_over_100x_smaller_than_mha_fp16():
    mha = cache_bytes_formula(preset("gpt2"), 1024, "fp16")
    q = cache_bytes_formula(dataclasses.replace(preset("mla_kvsplice_90"), cache_quant="int8"), 1024, "fp16")
    assert q == 1024 * 12 * (26 + 2) and mha == 1024 * 36864
    assert mha / q > 100  # 109.7×


def test_lowrank_and_dense_int8_on_llama():
    torch.manual_seed(0)
    model = sharpen(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128)), std=0.1)
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(2))
    eye = torch.eye(8)
    bases = KVBases([[HeadBases(eye[:, :6], eye[:, :6], eye, eye) for _ in range(2)] for _ in range(2)], "t", "post")
    for method, q_method in ((DenseKV(), DenseKV(cache_quant="int8")),
                             (LowRank(bases), LowRank(bases, cache_quant="int8"))):
        ref, n = sequence_nll(Decoder(model, method), ids, chunk_size=8)
        dec = Decoder(model, q_method)
        got, _ = sequence_nll(dec, ids, chunk_size=8)
        assert abs(got - ref) / ref < 0.01 and got != ref
        cache = dec.new_cache(2, capacity=40)
        dec(ids, cache)
        assert cache.nbytes() == measure_cache(cache).live_bytes
        if isinstance(q_method, LowRank):
            assert cache.nbytes() == cache.formula_nbytes() == 40 * 2 * 2 * 2 * ((6 + 8) + 2 * 2)
    dec = Decoder(model, LowRank(bases, cache_quant="int8"))
    with pytest.raises(TypeError, match="CoefficientCache"):
        dec(ids, Decoder(model, LowRank(bases)).new_cache(2))  # an unquantised cache for an int8 decoder


def test_bad_quant_options():
    with pytest.raises(ValueError, match="quant"):
        KVCache(1, 2, 4, 1, quant="int3")  # int8 and int4 exist (models.stream_cache)
    with pytest.raises(ValueError, match="GPTConfig.cache_quant"):
        GPTConfig(cache_quant="fp8")
    with pytest.raises(ValueError, match="SubsetCache does not quantise"):
        SubsetCache(1, 2, 4, 1, quant="int8")
    c = LatentCache(1, 8, 1, quant="int8")
    c.append(0, c=torch.randn(1, 3, 8))
    assert c.get(0)["c"].dtype == torch.float32 and c.stored(0)["c"].dtype == torch.int8
    assert math.isclose(c.bytes_per_token(), 8 + 2)


def test_each_stream_its_own_quantisation():
    """``quant={"k": "int8", "v": "int4"}``: the keys' rows are int8 + a scale, the values' 4-bit codes + a scale and
    minimum per group; ``get`` reads both back near the written rows; one mode for both is the plain form; a
    mapping naming another stream or mode is refused."""
    from models.quant import int4_row_bytes

    c = KVCache(2, 2, 64, 1, quant={"k": "int8", "v": "int4"})
    assert c.quant == {"k": "int8", "v": "int4"}
    k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    out = c.append(1, k=k, v=v)
    raw = c.stored(1)
    assert raw["k"].dtype == torch.int8 and raw["v"].dtype == torch.uint8 and raw["v"].shape[-1] == 32
    assert torch.equal(out["k"], dequantize(raw["k"], raw["k.scale"], torch.float32))
    assert (out["k"] - k).abs().max() < 0.03 < (out["v"] - v).abs().max() < 0.5  # 8 bits, then 4
    assert c.bytes_per_token() == 2 * 2 * (64 + 2 + int4_row_bytes(64))
    assert KVCache(1, 2, 4, 1, quant={"k": "int8", "v": "int8"}).quant == "int8"
    assert KVCache(1, 2, 4, 1, quant={"k": "int8"}).quant == {"k": "int8", "v": None}
    with pytest.raises(ValueError, match="quant must map streams"):
        KVCache(1, 2, 4, 1, quant={"c": "int8"})
    with pytest.raises(ValueError, match="quant must map streams"):
        KVCache(1, 2, 4, 1, quant={"k": "int2"})


def test_dequantised_views_live_in_one_reused_workspace():
    c = KVCache(3, 2, 8, 2, quant="int8", capacity=10)
    for layer in range(3):
        k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
        out = c.append(layer, k=k, v=v)
        raw = c.stored(layer)
        assert torch.equal(out["k"], dequantize(raw["k"], raw["k.scale"], torch.float32))
        assert torch.equal(out["v"], c.get(layer)["v"])
    # one k and one v scratch for all layers (one layer's rows at fp32), not counted as cache bytes
    assert c.workspace_nbytes() == 2 * (2 * 2 * 10 * 8 * 4)
    assert c.nbytes() == measure_cache(c).live_bytes == 3 * 2 * 2 * 2 * 4 * (8 + 2)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_converted_model_without_rope_dims_decodes_from_a_quantised_cache(quant):
    from models.mla_llama import MLALlama, MLALlamaConfig

    cfg = MLALlamaConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, head_dim=8, d_ff=48,
                         d_latent=16, rope_dims=0, cache_quant=quant)  # the RoPE-key rows have no numbers
    model = MLALlama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
        ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(4))
        full = model(ids)
        cache = model.new_cache(2)
        steps = torch.cat([model(ids[:, :4], cache)] + [model(ids[:, j:j + 1], cache) for j in range(4, 10)], 1)
    assert measure_cache(cache).live_bytes == model.cache_bytes_formula(2, 10, torch.float32)
    assert (steps - full).abs().max() < 0.5  # quantised latents: close to the full forward, not equal
