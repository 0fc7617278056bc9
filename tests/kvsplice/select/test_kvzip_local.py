"""Tests for ``kvzip(recon=local)`` (kvsplice.select.kvzip_local.LocalRepeat): its scores equal a dense softmax
over the same keys, built independently — the context ``ctx + repeat + ctx`` rotated at its true positions, the
prefill's queries of the context rotated at the repeat's, a mask keeping the prompt keys within ``reach`` of each
query and the first ``sinks``, the instruction, and the repeat's own keys within ``reach`` (causal) — in both
doors; a spec round-trips; the exact pass is untouched by the option."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tiny_models import IdsTokenizer as _Tok, random_ids as _ids, tiny_family  # noqa: E402

from kvsplice.adapters import adapter_for  # noqa: E402
from kvsplice.adapters.base import apply_rope  # noqa: E402
from kvsplice.core.build import build_method  # noqa: E402
from kvsplice.core.short_form import format_spec  # noqa: E402
from kvsplice.decode.decoder import Decoder  # noqa: E402
from kvsplice.hf.base import KVSpliceHFCache  # noqa: E402
from kvsplice.select.kvzip import KVzipSelection  # noqa: E402
from kvsplice.select.kvzip_local import LocalRepeat  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_family("llama", n_layer=3)


def _dense_local(q, k, kr, scale, offset_rope, reach, sinks) -> torch.Tensor:
    """The reference: one (T, S + T + R + T) softmax per query head with the kept keys unmasked → (B, Hkv, T)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qs = apply_rope(q.float(), *offset_rope)  # the repeat's queries
    kk = k.float().repeat_interleave(g, 1)  # (B, Hq, T, D)
    kri = kr.float().repeat_interleave(g, 1)
    lp = qs @ kk.transpose(-1, -2) * scale  # (B, Hq, T, T): prompt keys
    li = qs @ kri.transpose(-1, -2) * scale  # instruction keys
    lo = q.float() @ kk.transpose(-1, -2) * scale  # the repeat's own keys (relative positions as the prefill's)
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    keep_p = ((i - j).abs() <= reach) | (j < sinks)
    keep_o = (j <= i) & ((i - j <= reach) | (j < sinks))
    lp = lp.masked_fill(~keep_p, float("-inf"))
    lo = lo.masked_fill(~keep_o, float("-inf"))
    p = torch.softmax(torch.cat([lp, li, lo], -1), -1)[..., :t]  # (B, Hq, T, T)
    return p.reshape(b, hkv, g, t, t).amax(dim=(2, 3))


@pytest.mark.parametrize("chunk,reach", [(7, 5), (64, 3), (4, 40)])
def test_local_repeat_equals_a_dense_masked_softmax(chunk, reach) -> None:
    g = torch.Generator().manual_seed(0)
    b, hkv, grp, t, r, d = 1, 2, 3, 37, 5, 8
    q = torch.randn(b, hkv * grp, t, d, generator=g)
    k = torch.randn(b, hkv, t, d, generator=g)
    kr = torch.randn(b, hkv, r, d, generator=g)
    ang = torch.rand(1, 1, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # a rotation of the rotate-half layout
    got = torch.zeros(b, hkv, t)
    LocalRepeat(window=reach, sinks=3, chunk=chunk).score(q, k, kr, (cos, sin), 0.3, got)
    torch.testing.assert_close(got, _dense_local(q, k, kr, 0.3, (cos, sin), reach, 3), atol=1e-6, rtol=1e-5)


def _prefill_qk(model, ctx):
    """Every layer's post-RoPE prefill ``q, k`` of ``ctx`` (a full-cache Decoder that keeps them)."""
    from kvsplice.decode.dense import DenseKV

    class Keep(DenseKV):
        kept: dict = {}

        def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
            Keep.kept[layer] = (q, k)
            return super().attend(layer, q, k, v, cache, step, mask=mask, logw=logw)

    dec = Decoder(model, Keep())
    dec(ctx, dec.new_cache(1))
    return Keep.kept


def test_kvzip_local_scores_in_both_doors(model) -> None:
    """The method's layer scores = the instruction's exact pass (its queries over the prompt) maxed with the local
    repeat's dense reference, in the Decoder and in transformers."""
    ctx, rep = _ids(0, 30), _ids(1, 4)
    a = adapter_for(model)
    kept = _prefill_qk(model, ctx)
    method = KVzipSelection(6, prompt_ids=ctx, tokenizer=_Tok(rep), recon="local", reach=4)
    dec = Decoder(model, method)
    dec(ctx, dec.new_cache(1))
    hf = KVSpliceHFCache(model, method)
    with torch.no_grad():
        model(ctx, past_key_values=hf, use_cache=True)
    # the instruction's own pass: the exact method over an empty repeat of the prompt, i.e. its first R queries —
    # the reference re-runs the instruction through the layers with transformers' eager attention
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(torch.cat([ctx, rep], 1), output_attentions=True, use_cache=True)
    finally:
        model.config._attn_implementation = impl
    t, r = ctx.shape[1], rep.shape[1]
    hkv = model.config.num_key_value_heads
    pkv = out.past_key_values
    for layer in range(a.n_layer):
        att = out.attentions[layer][:, :, t:, :t]  # (1, Hq, R, T): the instruction's queries over the prompt
        inst = att.reshape(1, hkv, -1, r, t).amax(dim=(2, 3))
        kr = pkv.layers[layer].keys[:, :, t:]  # (1, Hkv, R, D): the instruction's keys at positions T ..
        q, k = kept[layer]
        shift = a.rope(k, t + r, 1, layer)
        want = torch.maximum(inst, _dense_local(q, k, kr, a.scale(layer), shift, 4, 4))
        torch.testing.assert_close(dec.method.layer_scores[layer], want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(hf.method.layer_scores[layer], want, atol=1e-5, rtol=1e-4)


def test_kvzip_local_spec_round_trips_and_is_refused_when_bad() -> None:
    spec = "select:kvzip(recon=local,reach=32,heads=pooled)@x4+int8"
    m = build_method(spec, prompt_len=64)
    assert m.recon == "local" and m.reach == 32
    assert build_method(format_spec(m.spec()), prompt_len=64).spec() == m.spec()
    with pytest.raises(ValueError, match="recon"):
        build_method("select:kvzip(recon=fast)@x4", prompt_len=64)
    with pytest.raises(ValueError, match="reach"):
        build_method("select:kvzip(recon=local,reach=0)@x4", prompt_len=64)
