"""Applying low-rank KV bases: decode through a coefficient cache for HF GPT-2, HF Llama (GQA, post-/pre-RoPE) and
our MHA GPT. Full rank reproduces the model; low rank caches exactly R numbers per head and token; the absorbed
(coefficient-space) path equals a naive reconstruction of K̂ and V̂."""

import copy
import math

import pytest
import torch
import transformers

from kvsplice.decode import Decoder, DenseKV, perplexity, sequence_nll
from kvsplice.lowrank.method import LowRank
from kvsplice.lowrank.bases import BasesMismatchError, HeadBases, KVBases
from models.stream_cache import KVCache
from kvsplice.lowrank.cache import CoefficientCache
from kvsplice.report.memory import measure_cache
from models import GPT, GPTConfig
from tiny_models import run_schedule

V, T, B = 61, 14, 2


# ------------------------------------------------------------------------------------------------ models
def _sharpen(model, std=0.25):
    """Random init with larger weights than the default 0.02, so attention is far from uniform and logits spread:
    any error in the cached path shows up well above the 1e-4 tolerance."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)  # norm gains near 1
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)  # non-zero biases exercise the bias folding
            else:
                p.copy_(std * noise)
    return model.eval()


def gpt2_model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  scale_attn_by_inverse_layer_idx=True)
    return _sharpen(transformers.GPT2LMHeadModel(cfg))


def llama_model(**kw):
    torch.manual_seed(0)
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    base.update(kw)
    return _sharpen(transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)))


def our_model():
    torch.manual_seed(0)
    return _sharpen(GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, attention="mha")))


MODELS = {"gpt2": gpt2_model, "llama": llama_model, "gpt": our_model}
SHAPES = {"gpt2": (2, 4, 4, 8), "llama": (2, 4, 2, 8), "gpt": (2, 4, 4, 8)}  # n_layer, Hq, Hkv, head_dim


def reference_logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


# ------------------------------------------------------------------------------------------------ bases
def _orth(d, g):
    return torch.linalg.qr(torch.randn(d, d, generator=g))[0]


def full_rank_bases(kind, n_layer, hkv, d, rope="post", seed=0):
    """Full-rank bases that reconstruct exactly: identity, random orthogonal (enc = dec = Q) or random oblique
    (enc = A, dec = A^{-T}, A well conditioned)."""
    g = torch.Generator().manual_seed(seed)

    def pair():
        if kind == "identity":
            return torch.eye(d), torch.eye(d)
        if kind == "orthogonal":
            q = _orth(d, g)
            return q, q.clone()
        s = torch.exp(torch.empty(d).uniform_(math.log(0.5), math.log(2.0), generator=g))
        a = _orth(d, g) @ torch.diag(s) @ _orth(d, g)
        return a, torch.linalg.inv(a).T.contiguous()

    layers = [[HeadBases(*pair(), *pair()) for _ in range(hkv)] for _ in range(n_layer)]
    return KVBases(layers, method=kind, rope=rope)


def low_rank_bases(ranks_k, ranks_v, d, rope="post", seed=0):
    """Random oblique rank-R bases (enc ≠ dec) with the given per-layer, per-head ranks."""
    g = torch.Generator().manual_seed(seed)

    def pair(r):
        enc = torch.randn(d, r, generator=g) / math.sqrt(d)
        dec = _orth(d, g)[:, :r] + 0.2 * torch.randn(d, r, generator=g)
        return enc, dec

    layers = [[HeadBases(*pair(rk), *pair(rv)) for rk, rv in zip(lk, lv)] for lk, lv in zip(ranks_k, ranks_v)]
    return KVBases(layers, method="random", rope=rope)


SCHEDULES = {"prefill": [T], "prefill+tokens": [5] + [1] * (T - 5), "chunks": [3, 3, 1, 4, 3]}
CASES = [("gpt2", "none"), ("llama", "post"), ("llama", "pre"), ("gpt", "none")]


# ------------------------------------------------------------------------------------------- 1. full rank
@pytest.mark.parametrize("family,rope", CASES)
def test_full_rank_reproduces_model(family, rope):
    model = MODELS[family]()
    n_layer, _, hkv, d = SHAPES[family]
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    ref = reference_logits(model, ids)
    assert ref.std() > 0.5  # the tolerance below is meaningful
    decoders = {"full-cache": Decoder(model, DenseKV())}
    for kind in ("identity", "orthogonal", "oblique"):
        bases = full_rank_bases(kind, n_layer, hkv, d, rope=rope)
        decoders[kind] = Decoder(model, LowRank(bases))
    decoders["oblique-naive"] = Decoder(model, LowRank(bases, impl="naive"))
    for name, dec in decoders.items():
        for sched, sizes in SCHEDULES.items():
            got, cache = run_schedule(dec, ids, sizes)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0, msg=lambda m: f"{name}/{sched}: {m}")
            assert isinstance(cache, KVCache if name == "full-cache" else CoefficientCache)


def test_generate_and_perplexity_full_rank_match_full_cache():
    model = our_model()
    dec_full = Decoder(model, DenseKV())
    dec_id = Decoder(model, LowRank(full_rank_bases("oblique", 2, 4, 8)))
    prompt = torch.randint(0, V, (B, 4), generator=torch.Generator().manual_seed(2))
    out = dec_id.generate(prompt, max_new_tokens=8)
    assert out.shape == (B, 12)
    assert torch.equal(out, dec_full.generate(prompt, max_new_tokens=8))
    assert torch.equal(out, model.generate(prompt, max_new_tokens=8, temperature=0))
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    logits = reference_logits(model, ids)
    ref_ppl = math.exp(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)))
    for dec in (dec_full, dec_id):
        for chunk in (None, 1, 5):
            assert perplexity(dec, ids, chunk_size=chunk) == pytest.approx(ref_ppl, rel=1e-5)
    assert sequence_nll(dec_id, ids)[1] == B * (T - 1)


# -------------------------------------------------------------------------------------------- 2. low rank
def _ranks(family, uniform):
    n_layer, _, hkv, d = SHAPES[family]
    if uniform:
        return [[3] * hkv for _ in range(n_layer)], [[5] * hkv for _ in range(n_layer)]
    rk = [[1 + (l + 2 * j) % d for j in range(hkv)] for l in range(n_layer)]
    rv = [[d - (l + j) % 4 for j in range(hkv)] for l in range(n_layer)]
    rk[0] = [2] * hkv  # layer 0 uniform (one grouped stream), layer 1 per-head streams
    rv[0] = [4] * hkv
    return rk, rv


@pytest.mark.parametrize("uniform", [True, False], ids=["shared-ranks", "per-head-ranks"])
@pytest.mark.parametrize("family,rope", CASES)
def test_low_rank_cache_bytes_and_absorbed_equals_naive(family, rope, uniform):
    model = MODELS[family]()
    n_layer, _, hkv, d = SHAPES[family]
    rk, rv = _ranks(family, uniform)
    bases = low_rank_bases(rk, rv, d, rope=rope)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    absorb, naive = Decoder(model, LowRank(bases)), Decoder(model, LowRank(bases, impl="naive"))
    ref = reference_logits(model, ids)
    for sched, sizes in SCHEDULES.items():
        got, cache = run_schedule(absorb, ids, sizes)
        want, _ = run_schedule(naive, ids, sizes)
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max() > 1e-2  # low rank really changes the logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{sched}: {m}")
    # exactly R_k + R_v numbers per head per token: bytes == formula == measured tensors
    formula = sum(sum(a) + sum(b) for a, b in zip(rk, rv)) * T * B * 4
    assert cache.nbytes() == formula == cache.formula_nbytes() == measure_cache(cache).live_bytes
    assert cache.elements_per_token() == bases.elements_per_token()
    for l in range(n_layer):
        views = cache.get(l)
        if len(set(rk[l])) == 1 and len(set(rv[l])) == 1:
            assert cache.grouped(l)
            assert views["k"].shape == (B, hkv, T, rk[l][0]) and views["v"].shape == (B, hkv, T, rv[l][0])
        else:
            assert not cache.grouped(l)
            for j in range(hkv):
                assert views[f"k{j}"].shape == (B, T, rk[l][j]) and views[f"v{j}"].shape == (B, T, rv[l][j])
    # exact capacity: the allocation is exactly the formula too
    cache = absorb.new_cache(B, capacity=T)
    absorb(ids, cache)
    assert cache.storage_nbytes() == measure_cache(cache).storage_bytes == formula


def _hf_reconstructing_copy(model, bases):
    """An independent reference for models without RoPE / pre-RoPE bases: the HF model itself with its key and
    value projections replaced by k ↦ k k_enc k_decᵀ, v ↦ v v_enc v_decᵀ per KV head, run by HF's own forward."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for l, heads in enumerate(bases.layers):
            if isinstance(m, transformers.GPT2LMHeadModel):
                attn = m.transformer.h[l].attn
                w, b = attn.c_attn.weight, attn.c_attn.bias  # Conv1D (in, 3·d): columns [q | k | v]
                d_model, d = w.shape[0], heads[0].head_dim
                for j, hb in enumerate(heads):
                    for part, (enc, dec) in ((1, (hb.k_enc, hb.k_dec)), (2, (hb.v_enc, hb.v_dec))):
                        cols = slice(part * d_model + j * d, part * d_model + (j + 1) * d)
                        w[:, cols] = w[:, cols] @ enc @ dec.T
                        b[cols] = b[cols] @ enc @ dec.T
            else:
                attn = m.model.layers[l].self_attn
                d = attn.head_dim
                for j, hb in enumerate(heads):
                    rows = slice(j * d, (j + 1) * d)
                    attn.k_proj.weight[rows] = (hb.k_enc @ hb.k_dec.T).T @ attn.k_proj.weight[rows]
                    attn.v_proj.weight[rows] = (hb.v_enc @ hb.v_dec.T).T @ attn.v_proj.weight[rows]
    return m


@pytest.mark.parametrize("family,rope", [("gpt2", "none"), ("llama", "pre")])
def test_low_rank_matches_hf_forward_with_reconstructed_kv(family, rope):
    model = MODELS[family]()
    _, _, hkv, d = SHAPES[family]
    rk, rv = _ranks(family, uniform=False)
    bases = low_rank_bases(rk, rv, d, rope=rope, seed=7)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    want = reference_logits(_hf_reconstructing_copy(model, bases), ids)
    got, _ = run_schedule(Decoder(model, LowRank(bases)), ids, SCHEDULES["prefill+tokens"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_coefficient_cache_layout_and_errors():
    cache = CoefficientCache([[2, 2], [1, 3]], [[4, 4], [2, 2]], batch_size=1)
    assert cache.grouped(0) and not cache.grouped(1)
    a, b = cache.append_coeffs(0, torch.ones(1, 2, 3, 2), torch.ones(1, 2, 3, 4))
    assert a[0].shape == (1, 2, 3, 2) and b[0].shape == (1, 2, 3, 4)
    a, b = cache.append_coeffs(1, [torch.ones(1, 3, 1), torch.ones(1, 3, 3)], [torch.ones(1, 3, 2)] * 2)
    assert [x.shape for x in a] == [(1, 1, 3, 1), (1, 1, 3, 3)]
    assert cache.seq_len == 3 and cache.nbytes() == (2 + 2 + 4 + 4 + 1 + 3 + 2 + 2) * 3 * 4
    with pytest.raises(ValueError, match="rank"):
        CoefficientCache([[0]], [[1]], batch_size=1)
    with pytest.raises(ValueError, match="separately"):
        cache.append_coeffs(1, [torch.ones(1, 1, 1)], [torch.ones(1, 1, 2)])


# ------------------------------------------------------------------------------------------- 3. errors
def test_unsupported_family_is_a_clear_error():
    olmo = transformers.OlmoForCausalLM(transformers.OlmoConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    for model in (olmo, torch.nn.Linear(2, 2),
                  GPT(GPTConfig(vocab_size=V, n_layer=1, n_head=2, d_model=16, attention="mla", d_latent=8))):
        with pytest.raises(ValueError, match="unsupported model family.*supported: .*gpt2, llama, mistral, qwen2, "
                                             "qwen3, phi3, gemma3_text"):
            Decoder(model, DenseKV())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mismatched_bases_raise(family):
    model = MODELS[family]()
    n_layer, _, hkv, d = SHAPES[family]
    with pytest.raises(BasesMismatchError, match="layers"):
        Decoder(model, LowRank(full_rank_bases("identity", n_layer + 1, hkv, d)))
    with pytest.raises(BasesMismatchError, match="KV heads"):
        Decoder(model, LowRank(full_rank_bases("identity", n_layer, hkv + 1, d)))
    with pytest.raises(BasesMismatchError, match="head dim"):
        Decoder(model, LowRank(full_rank_bases("identity", n_layer, hkv, d + 2)))
    if family == "llama":
        with pytest.raises(BasesMismatchError, match="RoPE"):
            Decoder(model, LowRank(full_rank_bases("identity", n_layer, hkv, d, rope="none")))
    dec = Decoder(model, LowRank(full_rank_bases("identity", n_layer, hkv, d)))
    with pytest.raises(TypeError, match="CoefficientCache"):
        dec(torch.zeros(1, 2, dtype=torch.long), Decoder(model, DenseKV()).new_cache(1))
    with pytest.raises(ValueError, match="batch size"):
        dec(torch.zeros(2, 2, dtype=torch.long), dec.new_cache(1))


# ------------------------------------------------------------------------------- calibrate + fit (integration)
@pytest.mark.parametrize("rope", ["post", "pre"])
def test_calibrated_kq_fit_on_llama(rope):
    """Calibrate a tiny GQA Llama on random tokens and fit ``kq``: full rank reproduces the logits; an energy-chosen
    (per-head) rank decodes with absorbed ≡ naive; bases of another model are refused by fingerprint."""
    calibrate = pytest.importorskip("kvsplice.lowrank.calibrate")
    fits = pytest.importorskip("kvsplice.lowrank.fits")
    model = llama_model()
    _, _, hkv, d = SHAPES["llama"]
    tokens = torch.randint(0, V, (4, 32), generator=torch.Generator().manual_seed(6))
    stats = calibrate.calibrate(model, [tokens], rope=rope, progress=False)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(7))
    ref = reference_logits(model, ids)

    bases = fits.fit_bases(stats, "kq", rank=d)
    assert bases.rope == rope and bases.meta.get("model_fingerprint")
    got, _ = run_schedule(Decoder(model, LowRank(bases)), ids, SCHEDULES["prefill+tokens"])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)

    low = fits.fit_bases(stats, "kq", energy=0.9)
    got, cache = run_schedule(Decoder(model, LowRank(low)), ids, SCHEDULES["chunks"])
    want, _ = run_schedule(Decoder(model, LowRank(low, impl="naive")), ids, SCHEDULES["chunks"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert cache.nbytes() == low.elements_per_token() * T * B * 4 == measure_cache(cache).live_bytes
    full = Decoder(model, DenseKV())
    assert math.isfinite(perplexity(Decoder(model, LowRank(low)), ids)) and perplexity(full, ids) > 1

    other = llama_model(num_hidden_layers=2)
    with torch.no_grad():
        other.lm_head.weight.add_(1.0)
        other.model.layers[0].self_attn.q_proj.weight.mul_(2.0)
    with pytest.raises(BasesMismatchError, match="fitted for model"):
        Decoder(other, LowRank(bases))


# ------------------------------------------------------------------------------------- real model (optional)
STORIES = __import__("pathlib").Path(__file__).resolve().parents[3].parent / "shared" / "data" / "stories260K"


@pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"stories260K not found under {STORIES}")
def test_stories260k_full_rank_kq_greedy_equals_hf_generate():
    """The real GQA + RoPE model: a full-rank ``kq`` fit (post- and pre-RoPE) decodes from the coefficient cache to
    exactly HF's own greedy ``generate``; a rank-4 fit stays finite and keeps 8/16 of the cached numbers."""
    conv = pytest.importorskip("kvsplice.convert.llama2c")
    calibrate = pytest.importorskip("kvsplice.lowrank.calibrate")
    fits = pytest.importorskip("kvsplice.lowrank.fits")
    cfg, sd = conv.read_llama2c(STORIES / "stories260K.bin")
    model = transformers.LlamaForCausalLM(conv.make_llama_config(cfg))
    model.load_state_dict(conv.llama2c_to_hf_state_dict(cfg, sd), strict=False)
    model.eval()
    bos = torch.tensor([[1]])
    want = model.generate(bos, max_new_tokens=24, do_sample=False)
    calib = Decoder(model, DenseKV()).generate(torch.ones(2, 1, dtype=torch.long), 63, temperature=1.0,
                     generator=torch.Generator().manual_seed(0))
    for rope in ("post", "pre"):
        stats = calibrate.calibrate(model, [calib], rope=rope, progress=False)
        d = stats.head_dim
        assert torch.equal(Decoder(model, LowRank(fits.fit_bases(stats, "kq", rank=d))).generate(bos, 24), want)
        low = Decoder(model, LowRank(fits.fit_bases(stats, "kq", rank=d // 2)))
        cache = low.new_cache(1)
        assert torch.isfinite(low(want, cache)).all()
        per_token = cfg["n_layers"] * cfg["n_kv_heads"] * (d // 2 + d // 2)  # half of full K/V's 2·d per head
        assert cache.nbytes() == per_token * want.shape[1] * 4 == measure_cache(cache).live_bytes
