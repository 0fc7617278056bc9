"""Tests for kvsplice.select.kvzip.KVzipSelection: the reconstruction scores equal the attention the model itself
pays to the context while reading "repeat" + context after it (transformers' eager attentions), in both doors;
the full budget is lossless; a budget keeps the top-scored tokens and the bytes equal the closed form; built from a
spec per prompt (``select:kvzip@...`` with ``prompt_ids`` / ``tokenizer``), its spec round-trips."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tiny_models import IdsTokenizer as _Tok, random_ids as _ids, tiny_family  # noqa: E402

from kvsplice.decode.decoder import Decoder  # noqa: E402
from kvsplice.decode.dense import DenseKV  # noqa: E402
from kvsplice.hf.base import KVSpliceHFCache  # noqa: E402
from kvsplice.core.build import build_method, needs_prompt  # noqa: E402
from kvsplice.core.short_form import format_spec, parse_spec  # noqa: E402
from kvsplice.select.kvzip import KVzipSelection  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_family("llama", n_layer=3)


def _kvzip(budget, ctx, repeat, **kw) -> KVzipSelection:
    return KVzipSelection(budget, prompt_ids=ctx, tokenizer=_Tok(repeat), **kw)


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
    ctx, rep = _ids(0, 40), _ids(1, 10)
    ref = _reference_scores(model, ctx, torch.cat([rep, ctx], 1))  # the instruction, then the context again
    method = _kvzip(10, ctx, rep, chunk=16)
    dec = Decoder(model, method)
    dec(ctx, dec.new_cache(1))
    hf = KVSpliceHFCache(model, method)
    with torch.no_grad():
        model(ctx, past_key_values=hf, use_cache=True)
    for layer, r in enumerate(ref):
        torch.testing.assert_close(dec.method.layer_scores[layer], r, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(hf.method.layer_scores[layer], r, atol=1e-5, rtol=1e-4)


def test_kvzip_full_budget_is_lossless_and_budget_keeps_top_tokens(model) -> None:
    ctx, rep, nxt = _ids(2, 30), _ids(3, 5), _ids(4, 5)
    full = Decoder(model)
    c = full.new_cache(1)
    full(ctx, c)
    want = full(nxt, c)
    dec = Decoder(model, _kvzip(30, ctx, rep))
    c2 = dec.new_cache(1)
    dec(ctx, c2)
    torch.testing.assert_close(dec(nxt, c2), want, atol=1e-5, rtol=1e-5)
    dec = Decoder(model, _kvzip(8, ctx, rep, store=DenseKV(cache_quant="int8")))
    c3 = dec.new_cache(1)
    dec(ctx, c3)
    assert c3.seq_len == 8 and c3.nbytes() == dec.formula_nbytes(c3)
    last = dec.method.layer_scores[len(dec.method.layer_scores) - 1][0]  # (Hkv, T): the last layer's scores
    idx, _ = dec.method.selector.select(torch.zeros(last.shape[0], 30, 4), torch.zeros(last.shape[0], 30, 4), 8)
    assert torch.equal(idx, last.topk(8, dim=-1).indices.sort(dim=-1).values)  # the top-scored tokens are kept


def test_kvzip_refuses_bad_input(model) -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        KVzipSelection(4, prompt_ids=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="sliding-window"):
        Decoder(tiny_family("mistral", window=8), _kvzip(4, _ids(0, 5), _ids(1, 2)))
    dec = Decoder(model, KVzipSelection(4))  # no prompt: it cannot re-read it
    with pytest.raises(ValueError, match="build it per prompt"):
        dec(_ids(0, 12), dec.new_cache(1))
    dec = Decoder(model, _kvzip(4, _ids(0, 10), _ids(1, 2)))  # built for another prompt
    with pytest.raises(ValueError, match="10-token prompt; the prefill has 12"):
        dec(_ids(0, 12), dec.new_cache(1))


def test_kvzip_from_a_spec_per_prompt(model) -> None:
    ctx, rep, nxt = _ids(5, 32), _ids(6, 4), _ids(7, 3)
    spec = parse_spec("select:kvzip@x4+int8")
    assert spec == {"name": "kvzip", "keep": 0.25, "store": {"name": "dense", "cache_quant": "int8"}}
    assert format_spec(spec) == "select:kvzip@0.25+int8" and needs_prompt(spec)
    assert not needs_prompt("select:snapkv@x4+int8")
    built = build_method(spec, prompt_ids=ctx, tokenizer=_Tok(rep))
    assert built.budget == 8 and built.spec() == {"name": "kvzip", "budget": 8,
                                                   "store": {"name": "dense", "cache_quant": "int8"}}
    direct = _kvzip(8, ctx, rep, store=DenseKV(cache_quant="int8"))
    outs = []
    for m in (built, direct):
        dec = Decoder(model, m)
        c = dec.new_cache(1)
        dec(ctx, c)
        outs.append(dec(nxt, c))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)  # the same method
    with pytest.raises(ValueError, match="come from the prompt, not from a spec"):
        build_method({"name": "kvzip", "budget": 4, "prompt_ids": [1, 2]})


def test_kvzip_mix_keeps_the_mixed_selectors_share_first() -> None:
    from kvsplice.core.build import build_selector
    from kvsplice.select.kvzip import ReconstructionScores

    scores = torch.rand(2, 20, generator=torch.Generator().manual_seed(0))
    k, v = torch.zeros(2, 20, 4), torch.zeros(2, 20, 4)
    sel = ReconstructionScores(build_selector({"name": "streaming_llm", "n_sink": 0}), share=0.5)
    sel.scores = scores
    idx, logw = sel.select(k, v, 6)
    for h in range(2):
        rest = scores[h, :17].topk(3).indices.tolist()  # the 3 best reconstruction scores outside the recent 3
        assert sorted(idx[h].tolist()) == sorted(rest + [17, 18, 19]) and not logw.any()
    plain = ReconstructionScores()
    plain.scores = scores
    assert torch.equal(plain.select(k, v, 6)[0], scores.topk(6).indices.sort(dim=-1).values)
    m = build_method("select:kvzip(mix=observed_attention,share=0.25)@x4+int8", prompt_len=40)
    assert m.spec() == {"name": "kvzip", "budget": 10, "mix": "observed_attention", "share": 0.25,
                        "store": {"name": "dense", "cache_quant": "int8"}} and m.selector.needs_queries
    with pytest.raises(ValueError, match="share must be a fraction"):
        KVzipSelection(4, mix="observed_attention", share=2)
    with pytest.raises(ValueError, match="unknown selector 'nosuch'"):
        KVzipSelection(4, mix="nosuch")


@pytest.mark.parametrize("spec", ["select:kvzip(mix=observed_attention,share=0.25)@x3+int8", "select:snapkv@0.4",
                                  "select:kvzip(heads=pooled)@x3+int8"])
def test_compress_prefill_builds_the_cache_attend_builds(model, spec) -> None:
    """``TokenSelection.compress_prefill`` (KVzip's override, and a plain selection's) from the prefill's kept
    ``q, k, v`` (``Kept.replay`` of :func:`kvsplice.select.replay.prefill_kept`) builds the
    very cache the ``Decoder``'s prefill (``attend``) builds: equal tensors, equal last and next logits."""
    from kvsplice.select.replay import can_replay, prefill_kept

    ctx, rep, nxt = _ids(8, 36), _ids(9, 4), _ids(10, 3)
    kept = prefill_kept(model, ctx, ctx.shape[1])
    want_dec = Decoder(model, build_method(spec, prompt_ids=ctx, tokenizer=_Tok(rep)))
    want = want_dec.new_cache(1)
    with torch.no_grad():
        last = want_dec(ctx, want, last_only=True)
    torch.testing.assert_close(kept.logits, last, atol=0, rtol=0)
    dec = Decoder(model, build_method(spec, prompt_ids=ctx, tokenizer=_Tok(rep)))
    assert can_replay(model, dec.method) and not can_replay(model, build_method("int8"))
    got = dec.new_cache(1)
    kept.replay(dec, got)
    for a, b in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(a, b)
    assert got.nbytes() == want.nbytes() and got.seq_len == want.seq_len < ctx.shape[1]
    torch.testing.assert_close(dec(nxt, got), want_dec(nxt, want), atol=0, rtol=0)


def test_kvzip_heads_union_keeps_one_token_set_per_layer(model) -> None:
    """``heads="union"``: every KV head keeps the same tokens, ranked by their best rank in any head (a token one
    head ranks first is kept by all); per sequence of ``n_kv_head`` rows; refused values name the choices."""
    from kvsplice.select.kvzip import ReconstructionScores

    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.0, 0.5],   # sequence 0, head 0: ranks 5 0 1 2 - 4
                           [0.0, 0.8, 0.1, 0.2, 0.3, 0.4],   # sequence 0, head 1: ranks - 5 1 2 3 4
                           [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],   # sequence 1, head 0
                           [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]])  # sequence 1, head 1
    k = torch.zeros(4, 6, 2)
    union = ReconstructionScores(heads="union")
    union.scores, union.n_kv_head = scores, 2
    idx, _ = union.select(k, k, 2)
    assert idx[:2].tolist() == [[0, 1], [0, 1]]  # each head's first-ranked token, in both heads
    assert idx[2:].tolist() == [[0, 5], [0, 5]]  # the two ends, each first in one head
    own = ReconstructionScores()
    own.scores = scores
    assert own.select(k, k, 2)[0][:2].tolist() == [[0, 5], [1, 5]]
    ctx, rep = _ids(11, 30), _ids(12, 4)
    dec = Decoder(model, build_method("select:kvzip(heads=union)@x3", prompt_ids=ctx, tokenizer=_Tok(rep)))
    c = dec.new_cache(1)
    dec(ctx, c)
    assert dec.method.spec()["heads"] == "union" and c.seq_len == 10
    from kvsplice.select.replay import prefill_kept

    prompt = prefill_kept(model, ctx, ctx.shape[1])
    for layer in range(model.config.num_hidden_layers):
        kept = c.kept.get(layer)["k"][0]  # (Hkv, 10, D)
        full = prompt.qkv[layer][1][0]  # (Hkv, T, D): the prompt's keys
        pos = torch.cdist(kept, full).argmin(dim=-1)  # (Hkv, 10): which prompt token each kept key is
        assert pos.shape[0] > 1 and (pos == pos[:1]).all()  # the same tokens in every head
        ranks = dec.method.layer_scores[layer][0].argsort(-1).argsort(-1)  # (Hkv, T)
        assert (ranks.amax(0)[pos[0]].min() >= ranks.amax(0).sort().values[-10])  # the best-ranked by any head
    with pytest.raises(ValueError, match="heads must be one of 'own', 'union', 'pooled'"):
        KVzipSelection(4, heads="all")


def test_evaluate_each_contexts_share_the_pass_and_votes_with_the_same_result(model) -> None:
    """Candidates measured window by window with one kept context per window (the planner's tuning perplexity):
    each window's exact prefill, KVzip's reconstruction pass and the mixed-in votes are made once and reused by
    every token selection (int8 prefills itself) — the same perplexity, to the bit, and bytes as each alone."""
    from kvsplice.core.build import per_prompt
    from kvsplice.evaluation.protocol import evaluate_each

    windows = torch.cat([_ids(s, 40) for s in (11, 12)])  # (2, 40)
    rep = _Tok(_ids(6, 4))
    specs = [parse_spec(s) for s in ("select:kvzip(mix=observed_attention,share=0.5)@x4+int8",
                                     "select:kvzip(mix=observed_attention,share=0.25)@x2", "select:kvzip@x4",
                                     "select:snapkv@x2+int8", "int8")]  # a selection replays too; int8 cannot
    contexts = [{}, {}]
    for spec in specs:
        made = per_prompt(lambda s=spec, **ctx: build_method(s, **ctx), rep)
        alone = evaluate_each(model, made, windows, prompt_len=32)
        kept = evaluate_each(model, made, windows, prompt_len=32, contexts=contexts)
        assert kept["ppl"] == alone["ppl"] and kept["bytes_per_token"] == alone["bytes_per_token"], spec
    for c in contexts:
        passes = [v for k, v in c.items() if k[0] == "kvzip"]
        assert len(passes) == 1 and len(passes[0]) == model.config.num_hidden_layers  # one pass for all three
        assert c[("prefill", 32)].cache is None and c[("prefill", 32)].nbytes > 0  # one exact prefill, replayed
        assert all(len(v) == 1 for v in c["mix_votes"].values())  # one votes key: both mixes read it
    with pytest.raises(ValueError, match="one dict per window"):
        evaluate_each(model, made, windows, prompt_len=32, contexts=[{}])
