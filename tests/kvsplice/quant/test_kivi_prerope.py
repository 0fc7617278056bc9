"""KIVI with keys quantised before RoPE (``kvsplice.quant.prerope``): lossless when nothing is quantised (both doors,
left padding included), the keys attended are ``rot(dequant(quant(unrot(k))))`` — plain KIVI of the un-rotated keys,
rotated back at their positions —, measured bytes == formula == KIVI's, both doors agree, refusals are one line, and
a real pretrained model (stories260K) decodes through it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvsplice.adapters import adapter_for
from kvsplice.adapters.base import apply_rope
from kvsplice.core.method import Step
from kvsplice.core.build import build_method
from kvsplice.core.short_form import parse_spec
from kvsplice.decode import Decoder
from kvsplice.hf import KVSpliceHFCache
from kvsplice.quant import KIVI, KIVICache, PreRopeKIVI
from kvsplice.report.memory import measure_cache
from test_stack import assert_same, both_doors, ids_of, tiny
from tiny_models import tiny_family

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
TEXT = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"


def test_a_window_over_every_token_is_lossless_in_both_doors_and_under_left_padding():
    model = tiny("llama")
    ids = ids_of(2, 14, 1)
    runs = both_doors(model, PreRopeKIVI(bits=2, group=8, residual=64), ids[:, :10], [ids[:, 10:11], ids[:, 11:14]])
    with torch.no_grad():
        want = model(ids).logits
    for door, (logits, _) in runs.items():
        torch.testing.assert_close(torch.cat(logits, 1), want, atol=1e-4, rtol=0, msg=lambda m: door + m)
    # a left-padded batch in generate(): the un-rotation and re-rotation use each row's own positions
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids[:, :10], past_key_values=transformers.DynamicCache(config=model.config), **kw)
        got = model.generate(ids[:, :10], past_key_values=KVSpliceHFCache(model, "kivi2p(group=8,residual=64)"), **kw)
    assert torch.equal(got, ref)
    # what the cache holds are the un-rotated keys, each row's at its own positions (generate's numbering): the padded
    # row's are the Decoder's (which never rotates them) of that row alone
    hf = KVSpliceHFCache(model, PreRopeKIVI(group=8, residual=64))
    with torch.no_grad():
        model(ids[:, :10], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), past_key_values=hf)
    dec = Decoder(model, PreRopeKIVI(group=8, residual=64))
    alone = dec.new_cache(1)
    dec(ids[1:, 3:10], alone)
    for layer in range(alone.n_layer):
        torch.testing.assert_close(hf.method_cache.get(layer)["k"][1:, :, 3:], alone.get(layer)["k"], atol=1e-5,
                                   rtol=1e-5)


def test_the_keys_attended_are_kivi_of_the_unrotated_keys_rotated_back_and_the_doors_store_the_same_codes():
    """Keys arrive rotated (the HF door) or un-rotated (the Decoder, ``k_rotated=False``). Prefill 20 tokens then one
    decode step; the reference is a plain :class:`KIVICache` of the un-rotated keys, rotated at positions 0..20 by the
    model's own rotary. Both ways store bit-identical caches (the Decoder's keys are rotated, then un-rotated, as the
    HF door's: a last-bit difference would flip codes at a step's edge)."""
    model = tiny("llama")  # head_dim 8
    a = adapter_for(model)
    kw = dict(bits=4, group=8, residual=4)
    method = PreRopeKIVI(**kw).bind(a, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    b, t, d = 2, 21, a.head_dim
    q = torch.randn(b, a.n_head, t, d, generator=g)
    k = torch.randn(b, a.n_kv_head, t, d, generator=g) * torch.linspace(0.2, 4.0, d)  # un-rotated, outlier channels
    v = torch.randn(b, a.n_kv_head, t, d, generator=g)
    cos, sin = a.rotary_embedding(0)(k, torch.arange(t)[None])  # (1, T, D)
    k_rot = apply_rope(k, cos, sin)
    scales = [d ** -0.5] * a.n_layer
    ref = KIVICache(a.n_layer, a.n_kv_head, d, b, **kw)
    want = []
    for s, e in ((0, 20), (20, 21)):
        kv = ref.append(0, k[:, :, s:e], v[:, :, s:e])  # plain KIVI of the un-rotated keys
        want.append(Step(a, s, e - s, scales).attend(0, q[:, :, s:e], apply_rope(kv["k"], cos[:, :e], sin[:, :e]),
                                                       kv["v"]))
    assert ref.get(0)["k"][:, :, :16].sub(k[:, :, :16]).abs().max() > 1e-3  # 16 tokens quantised: lossy
    runs = {}
    for rotated_in in (True, False):
        cache = method.new_cache(b, dtype=torch.float32, device="cpu")
        got = [method.attend(0, q[:, :, s:e], (k_rot if rotated_in else k)[:, :, s:e], v[:, :, s:e], cache,
                             Step(a, s, e - s, scales, k_rotated=rotated_in)) for s, e in ((0, 20), (20, 21))]
        assert_same(got, want, atol=1e-5, what="pre-RoPE KIVI")
        torch.testing.assert_close(cache.get(0)["k"], ref.get(0)["k"], atol=1e-5, rtol=0)  # un-rotated, dequantised
        runs[rotated_in] = got, cache
    for x, y in zip(runs[True][1].tensors(), runs[False][1].tensors()):  # codes, statistics, window: bit for bit
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(runs[True][0], runs[False][0]))
    # plain KIVI quantises the rotated keys: a different cache
    post = KIVI(**kw).bind(a, dtype=torch.float32, device=torch.device("cpu"))
    pc = post.new_cache(b, dtype=torch.float32, device="cpu")
    y = post.attend(0, q[:, :, :20], k_rot[:, :, :20], v[:, :, :20], pc, Step(a, 0, 20, scales))
    assert (y - runs[True][0][0]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bytes_are_kivis_at_every_length_and_the_doors_agree(family):
    model = tiny("llama") if family == "llama" else tiny_family("qwen3", vocab_size=96)  # qwen3: per-head k norm
    a = adapter_for(model)
    ids = ids_of(2, 40, 2)
    method = PreRopeKIVI(bits=4, group=8, residual=4)
    steps = [ids[:, t:t + 1] for t in range(19, 23)] + [ids[:, 23:40]]
    runs = both_doors(model, method, ids[:, :19], steps)
    assert_same(runs["decoder"][0], runs["hf"][0], atol=1e-5, what="decoder vs hf")
    plain = Decoder(model, KIVI(bits=4, group=8, residual=4)).method
    for door, (_, cache) in runs.items():
        store = cache.method_cache if door == "hf" else cache
        assert store.seq_len == 40
        formula = cache.formula_nbytes() if door == "hf" else Decoder(model, method).formula_nbytes(cache)
        assert measure_cache(cache).live_bytes == cache.nbytes() == formula == plain.bytes_formula(2, 40, torch.float32)
    dec = Decoder(model, method)
    cache = dec.new_cache(2)
    for t in range(0, 40, 3):  # every length a call leaves: measured == formula == KIVI's
        dec(ids[:, t:t + 3], cache)
        n = cache.seq_len
        assert measure_cache(cache).live_bytes == dec.formula_nbytes(cache) == plain.bytes_formula(2, n, torch.float32)
    full = a.n_layer * a.n_kv_head * 2 * 40 * 2 * a.head_dim * 4  # fp32 keys and values
    assert cache.nbytes() < full / 2  # 4-bit codes + per-group scales of 8 numbers, 4 tokens at fp32


def test_the_short_form_and_the_refusals():
    assert parse_spec("kivi4p(residual=32)") == {"name": "kivi_prerope", "bits": 4, "residual": 32}
    m = build_method("kivi4p(residual=32)")
    assert isinstance(m, PreRopeKIVI) and m.spec() == {"name": "kivi_prerope", "residual": 32}
    with pytest.raises(ValueError, match="no RoPE"):
        Decoder(tiny("gpt2"), PreRopeKIVI())
    with pytest.raises(ValueError, match="partial"):
        Decoder(tiny_family("phi3", partial_rotary=0.5), PreRopeKIVI(group=16))
    with pytest.raises(ValueError, match="positions"):  # a token subset is held out of order
        Decoder(tiny("llama"), build_method("select:snapkv@x2+kivi4p(group=8)", prompt_len=20))
    with pytest.raises(ValueError, match="bits"):
        PreRopeKIVI(bits=3)


def test_the_planner_tries_kivi2_before_rope_alone_where_rope_rotates_the_whole_head():
    from kvsplice.planning.search import candidate_stores, fit_budget
    from kvsplice.planning.spec import spec_label

    def pre(stores):
        return [(s["bits"], s["residual"]) for s in stores if s["name"] == "kivi_prerope"]

    assert pre(candidate_stores(True, 64)) == [(2, 128), (2, 32)]
    assert pre(candidate_stores(True, 64, rotary_dim=32)) == pre(candidate_stores(False, 64)) == []
    a = adapter_for(tiny("llama"))  # 2 layers, 2 KV heads of 8
    store = {"name": "kivi_prerope", "bits": 2, "group": 8, "residual": 32}
    assert fit_budget(store, a, 64, 1e6, selector="snapkv") == store  # fits alone
    assert fit_budget(store, a, 64, 10.0, selector="snapkv") is None  # over budget: it cannot hold a selection
    assert spec_label(store) == "kivi2p(g8,r32)"  # the planner's label, as the alias


@pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file() or not TEXT.is_file(),
                    reason=f"stories260K / TinyStories not found under {DATA}")
def test_a_real_model_decodes_and_keeps_close_to_the_full_cache(tmp_path):
    from kvsplice.convert.llama2c import convert_llama2c

    path = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path / "s260k")
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok(TEXT.read_text()[:2000])["input_ids"][:160]])  # (1, 160)
    with torch.no_grad():
        full = model(ids).logits[0, 128:].log_softmax(-1)
    nll = {}
    for name in ("kivi4", "kivi4p"):
        dec = Decoder(model, build_method(f"{name}(group=8,residual=16)"))
        cache = dec.new_cache(1)
        dec(ids[:, :128], cache)  # prefill, then decode one token at a time
        lp = torch.cat([dec(ids[:, t:t + 1], cache) for t in range(128, 160)], 1)[0].log_softmax(-1)
        assert measure_cache(cache).live_bytes == dec.formula_nbytes(cache)
        nll[name] = -lp[:-1].gather(1, ids[0, 129:, None]).mean()
        assert 0 < (lp - full).abs().max() < 2.0, name  # lossy, yet close to the full cache
    nll["full"] = -full[:-1].gather(1, ids[0, 129:, None]).mean()
    assert abs(nll["kivi4p"] - nll["full"]) < 0.2, nll
    hf = KVSpliceHFCache(model, "kivi4p(group=8,residual=16)")  # the same codes in transformers' forward
    with torch.no_grad():
        model(ids[:, :128], past_key_values=hf)
        lp_hf = torch.cat([model(ids[:, t:t + 1], past_key_values=hf).logits for t in range(128, 160)], 1)
    torch.testing.assert_close(lp_hf[0].log_softmax(-1), lp, atol=1e-5, rtol=0)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids[:, :64], past_key_values=KVSpliceHFCache(model, "kivi4p(group=8,residual=16)"), **kw)
    assert torch.equal(out, Decoder(model, build_method("kivi4p(group=8,residual=16)")).generate(ids[:, :64], 16))
