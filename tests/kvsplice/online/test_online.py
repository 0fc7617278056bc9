"""Online frequent-directions decoding (kvsplice.online.method): with τ = 0 and full rank it reproduces HF Llama (GQA +
RoPE), HF GPT-2 and our MHA GPT; at low rank the §3.5 bounds hold on every layer — for online decoding (in-run and
teacher-forced) and for global bases — on tiny random models, a tiny *trained* GPT and the real stories260K."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import run_schedule, sharpen as _sharpen

from kvsplice.lowrank.bases import HeadBases, KVBases
from kvsplice.adapters.capture import extract_qkv
from kvsplice.lowrank.calibrate import calibrate
from kvsplice.online.chunked import ChunkedCache
from kvsplice.lowrank.fits import fit_bases
from kvsplice.lowrank.diagnostics import bases_diagnostics
from kvsplice.core.diagnostics import attention_diagnostics, format_diagnostics
from kvsplice.online.diagnostics import online_qkv_diagnostics
from kvsplice.decode import Decoder, DenseKV
from kvsplice.online.method import OnlineDecoder, calibrate_thresholds
from models import GPT, GPTConfig

V, T = 61, 24
DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
VAL_TXT = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
TRAIN_TXT = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"




# ------------------------------------------------------------------------------------------------ models


def llama_model():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=None)
    return _sharpen(transformers.LlamaForCausalLM(cfg))


def gpt2_model():
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  scale_attn_by_inverse_layer_idx=True, bos_token_id=None, eos_token_id=None)
    return _sharpen(transformers.GPT2LMHeadModel(cfg))


def our_model():
    return _sharpen(GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, attention="mha")))


MODELS = {"llama": llama_model, "gpt2": gpt2_model, "gpt": our_model}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {name: fn() for name, fn in MODELS.items()}


def reference_logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _ids(b=2, t=T, seed=0):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _assert_bounds(diag, what):
    for l, d in enumerate(diag):
        assert d["holds"], (what, l, d)
        for name in ("logit", "softmax", "softmax_sinh", "softmax_obs", "output", "output_sinh"):
            assert d[f"{name}_tightest"] >= 1 - 1e-9, (what, l, name, d)
        if "holds_recorded" in d:
            assert d["holds_recorded"], (what, l, d)
        for kv in ("k", "v"):
            if f"fd_holds_{kv}" in d:
                assert d[f"fd_holds_{kv}"], (what, l, kv, d)
                assert d[f"fd_residual_{kv}"] <= d[f"fd_residual_bound_{kv}"] * (1 + 1e-6) + 1e-6
        if "attend_matches" in d:  # the decoder's chunked output equals softmax(ℓ̂) v̂ from the reconstruction
            assert d["attend_matches"] < 1e-4 * (1 + d["v_norm"]), (what, l, d["attend_matches"])


# ------------------------------------------------------------------------------------------------ exactness
EXACT_OPTS = [dict(warmup=0), dict(warmup=4, max_chunk_len=5, max_chunks=2),
              dict(warmup=3, max_chunk_len=7, shared_value_basis=True)]


@pytest.mark.parametrize("name", list(MODELS))
def test_full_rank_tau0_reproduces_the_model(models, name):
    """τ_k = τ_v = 0, rank = head dim: every chunk's bases span the whole space, so prefill, prefill + tokens and
    multi-token chunks all give the original model's logits (1e-4), whatever the chunking / merge / warm-up."""
    model = models[name]
    t = 16
    ids = _ids(t=t)
    ref = reference_logits(model, ids)
    d = model.config.head_dim if name == "llama" else 8
    for opts in EXACT_OPTS:
        dec = OnlineDecoder(model, rank_k=d, rank_v=d, tau_k=0.0, tau_v=0.0, **opts)
        for sizes in ([t], [5] + [1] * (t - 5), [3, 6, 1, 4, 2]):
            out, cache = run_schedule(dec, ids, sizes)
            assert cache.seq_len == t and isinstance(cache, ChunkedCache)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0, msg=lambda m: f"{name} {opts} {sizes}: {m}")


def test_low_rank_stores_coefficients_and_prefill_equals_decode(models):
    """Below full rank the cache holds r_k + r_v coefficients per token (outside the warm-up) and, without merges,
    a prefill gives exactly the token-by-token logits (the online rule does not depend on call sizes)."""
    model = models["llama"]
    ids = _ids()
    dec = OnlineDecoder(model, rank_k=3, rank_v=2, tau_k=2.0, tau_v=2.0, max_chunk_len=8, warmup=4)
    full, cache = run_schedule(dec, ids, [T])
    steps, _ = run_schedule(dec, ids, [4] + [1] * (T - 4))
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)
    assert (reference_logits(model, ids) - full).abs().max() > 1e-2  # really approximate
    per_head = (T - 4) * (3 + 2) + 4 * (8 + 8)
    assert cache.elements_per_token() == pytest.approx(2 * 2 * per_head / T)  # per sequence: 2 layers × 2 KV heads
    assert dec.perplexity(ids, chunk_size=None) == pytest.approx(dec.perplexity(ids, chunk_size=1), rel=1e-5)
    with pytest.raises(TypeError, match="ChunkedCache"):
        dec(ids, Decoder(model, DenseKV()).new_cache(2))


@pytest.mark.parametrize("name", list(MODELS))
def test_bounds_hold_on_random_models(models, name):
    """Low rank, thresholds, merges: in-run and teacher-forced diagnostics on every layer; the decoder's output
    equals the reconstruction's; the cache's recorded residual maxima and the FD residual bound hold."""
    model = models[name]
    ids = _ids()
    for opts in (dict(rank_k=3, tau_k=1.0, tau_v=1.0, max_chunk_len=8, max_chunks=3, warmup=4),
                 dict(rank_k=4, rank_v=2, max_chunk_len=6, shared_value_basis=True, fit_first_token=True),
                 dict(rank_k=2, tau_k=0.5, relative=True, min_chunk_len=4, fd_decay=0.9)):
        logits, diag = OnlineDecoder(model, **opts).diagnose(ids)
        assert logits.shape == (2, T, V) and len(diag) == 2
        _assert_bounds(diag, (name, opts, "run"))
        assert max(d["logit_err"] for d in diag) > 1e-3  # a real approximation, not a trivial pass
        _assert_bounds(online_qkv_diagnostics(model, ids, **opts), (name, opts, "exact"))


# ------------------------------------------------------------------------------------------------ global bases
def _oblique_bases(n_layer, hkv, d, r, rope, seed=0):
    g = torch.Generator().manual_seed(seed)

    def pair():
        enc = torch.randn(d, r, generator=g) / math.sqrt(d)
        dec = torch.linalg.qr(torch.randn(d, d, generator=g))[0][:, :r] + 0.2 * torch.randn(d, r, generator=g)
        return enc, dec

    return KVBases([[HeadBases(*pair(), *pair()) for _ in range(hkv)] for _ in range(n_layer)], "random", rope)


def test_bases_diagnostics_conventions(models):
    """Global bases: full rank gives zero error; for oblique low-rank bases the diagnostic logits are exactly the
    coefficient logits ``(q k_dec)·(k k_enc)``; bounds hold post- and pre-RoPE and without RoPE."""
    ids = _ids(b=1)
    model = models["llama"]
    eye = KVBases([[HeadBases(*(torch.eye(8),) * 4) for _ in range(2)] for _ in range(2)], "identity", "post")
    for d in bases_diagnostics(model, eye, ids):
        assert d["logit_err"] < 1e-9 and d["output_err"] < 1e-9
    bases = _oblique_bases(2, 2, 8, 3, "post")
    diag = bases_diagnostics(model, bases, ids)
    x = extract_qkv(model, ids)[0]  # (B, H, T, d), post-RoPE
    q, k = x["q"][0].transpose(0, 1).double(), x["k"][0].transpose(0, 1).double()  # (T, Hq, d), (T, Hkv, d)
    scale = model.model.layers[0].self_attn.scaling
    worst = 0.0
    for h in range(4):
        hb = bases.layers[0][h // 2]
        exact = scale * q[:, h] @ k[:, h // 2].T
        coef = scale * (q[:, h] @ hb.k_dec.double()) @ (k[:, h // 2] @ hb.k_enc.double()).T
        worst = max(worst, float(torch.tril(exact - coef).abs().max()))
    assert diag[0]["logit_err"] == pytest.approx(worst, rel=1e-9)
    _assert_bounds(diag, "post")
    _assert_bounds(bases_diagnostics(model, _oblique_bases(2, 2, 8, 3, "pre"), ids), "pre")
    _assert_bounds(bases_diagnostics(models["gpt2"], _oblique_bases(2, 4, 8, 3, "none"), ids), "gpt2")


def test_attention_diagnostics_detects_a_violation():
    """The checker is not vacuous: a forged k̂ that is *not* what the bound assumes (tampered logits) is caught
    when the residual used for the bound is wrong, and identical inputs give zero error and infinite slack."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    d = attention_diagnostics(q, k, v, k, v, 0.5)
    assert d["logit_err"] == 0 and d["output_err"] == 0 and d["holds"] and d["logit_slack"] == math.inf
    k_hat = k + 0.3 * torch.randn(k.shape, generator=g, dtype=torch.float64)
    d = attention_diagnostics(q, k, v, k_hat, v, 0.5, key_residual_recorded=torch.full((1, 2), 1e-3))
    assert d["holds"] and not d["holds_recorded"]  # an understated cache residual violates the a-priori bound


# ------------------------------------------------------------------------------------------------ trained GPT
@pytest.fixture(scope="module")
def trained_gpt():
    """A tiny models.GPT trained for 120 steps on a synthetic stream (noisy copy of a random period-7 pattern
    plus a Markov chain), so its attention is structured like a trained model's, not random."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    vocab, n = 32, 64
    cfg = GPTConfig(vocab_size=vocab, n_layer=2, n_head=4, d_model=32, block_size=n, attention="mha")
    model = GPT(cfg)
    trans = torch.randint(0, vocab, (vocab, 3), generator=g)  # each token has 3 likely successors

    def batch(b):
        x = torch.empty(b, n + 1, dtype=torch.long)
        period = torch.randint(0, vocab, (b, 7), generator=g)
        x[:, 0] = torch.randint(0, vocab, (b,), generator=g)
        for t in range(1, n + 1):
            markov = trans[x[:, t - 1], torch.randint(0, 3, (b,), generator=g)]
            x[:, t] = torch.where(torch.rand(b, generator=g) < 0.5, period[:, t % 7], markov)
        return x

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(120):
        x = batch(16)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3  # it learned something
    return model, batch(8)[:, :n]


def test_bounds_hold_on_a_trained_gpt(trained_gpt):
    """Every layer of a trained GPT: online (in-run, teacher-forced) and global (kq, ksvd) bounds hold; the slack
    is printed (``pytest -s``)."""
    model, ids = trained_gpt
    stats = calibrate(model, [ids[:4]], progress=False)
    ev = ids[4:6]
    reports = {
        "online run": OnlineDecoder(model, rank_k=4, tau_k=1.0, max_chunk_len=16, max_chunks=3).diagnose(ev)[1],
        "online exact": online_qkv_diagnostics(model, ev, rank_k=4, tau_k=1.0, max_chunk_len=16, max_chunks=3),
        "kq r4": bases_diagnostics(model, fit_bases(stats, "kq", rank=4), ev),
        "ksvd r4": bases_diagnostics(model, fit_bases(stats, "ksvd", rank=4), ev),
    }
    for what, diag in reports.items():
        _assert_bounds(diag, what)
        print("\n" + format_diagnostics(diag, f"trained GPT, {what}"))


# ------------------------------------------------------------------------------------------------ stories260K
@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "stories260K.bin").is_file() or not VAL_TXT.is_file() or not TRAIN_TXT.is_file():
        pytest.skip(f"stories260K / TinyStories reference data not found under {DATA}")
    from kvsplice.convert import llama2c as conv

    cfg, sd = conv.read_llama2c(STORIES / "stories260K.bin")
    model = transformers.LlamaForCausalLM(conv.make_llama_config(cfg))
    model.load_state_dict(conv.llama2c_to_hf_state_dict(cfg, sd), strict=False)
    tok = conv.build_tokenizer(*conv.read_llama2c_tokenizer(STORIES / "tok512.bin")[:2])

    def ids(path, sep, n):
        stories = [s.strip() for s in path.read_text(encoding="utf-8")[:60_000].split(sep) if s.strip()]
        return torch.tensor([i for s in stories for i in tok(s)["input_ids"]][:n])

    return model.eval(), ids(VAL_TXT, "\n\n", 192)[None], ids(TRAIN_TXT, "<|endoftext|>", 2048).view(8, 256)


def test_stories260k_bounds_hold_every_layer(stories):
    """The real GQA + RoPE model on real text: every reported bound holds on every layer for online decoding
    (in-run and teacher-forced) and for global post-RoPE kq / gqa-sum bases; prints the slack."""
    model, ev, calib = stories
    stats = calibrate(model, [calib], progress=False)
    opts = dict(rank_k=3, rank_v=3, max_chunk_len=32, fd_decay=0.95)
    logits, run = OnlineDecoder(model, **opts).diagnose(ev)
    assert torch.isfinite(logits).all()
    reports = {"online run": run, "online exact": online_qkv_diagnostics(model, ev, **opts),
               "online τ": online_qkv_diagnostics(model, ev, rank_k=3, tau_k=0.3, relative=True, min_chunk_len=8,
                                                  max_chunk_len=64, max_chunks=4),
               "kq r4": bases_diagnostics(model, fit_bases(stats, "kq", rank=4), ev),
               "gqa-sum r4": bases_diagnostics(model, fit_bases(stats, "gqa-sum", rank=4), ev)}
    for what, diag in reports.items():
        assert len(diag) == 5
        _assert_bounds(diag, what)
        print("\n" + format_diagnostics(diag, f"stories260K, {what}"))
    assert all(d["chunks_max"] >= 2 for d in run)


# ------------------------------------------------------------------------------------------------ eval_bases CLI
def test_eval_bases_cli_fd_online_and_diagnostics(stories, tmp_path, capsys):
    """``kvsplice eval-bases --method fd-online`` on stories260K: perplexity through the chunked cache, bytes
    that equal the cache's tensors, J, and the per-layer bound diagnostics (also attached to saved bases)."""
    eval_bases = pytest.importorskip("kvsplice.cli.eval_bases")
    if "fd-online" not in eval_bases.EVALUATORS:
        pytest.skip("eval_bases has no fd-online method")
    from kvsplice.convert import llama2c as conv

    model, _, calib = stories
    out = conv.convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path / "s260k")
    common = ["--model", str(out), "--data", str(VAL_TXT), "--tokens", "256", "--seq-len", "128", "--batch-size",
              "2", "--err-windows", "1", "--no-progress"]
    rc = eval_bases.main(common + ["--method", "fd-online", "--rank", "3", "--max-chunk-len", "16", "--fd-decay",
                                   "0.9", "--diagnostics", "--json", str(tmp_path / "fd.json")])
    text = capsys.readouterr().out
    assert rc == 0 and "fd-online r=3/3 L=16 γ=0.9" in text and "vs their bounds" in text
    r = json.loads((tmp_path / "fd.json").read_text())["results"][0]
    assert r["method"] == "fd-online" and r["cache"]["bytes_match"] and math.isfinite(r["ppl"])
    br = r["cache"]["per_sequence_breakdown"]
    assert br["key_bases"] > 0 and br["sketch"] > 0 and max(max(j) for j in r["chunks"]) >= 8  # 128 tokens, L=16
    assert len(r["diagnostics"]) == 5 and all(d["holds"] for d in r["diagnostics"])
    stats = calibrate(model, [calib[:2]], progress=False)
    path = fit_bases(stats, "kq", rank=4).save(tmp_path / "kq4.safetensors")
    assert eval_bases.main(common + ["--bases", str(path), "--diagnostics", "--json", str(tmp_path / "kq.json")]) == 0
    r = json.loads((tmp_path / "kq.json").read_text())["results"][0]
    assert len(r["diagnostics"]) == 5 and all(d["holds"] for d in r["diagnostics"])
    assert eval_bases.main(common + ["--bases", str(path), "--json", str(tmp_path / "plain.json")]) == 0
    assert "diagnostics" not in json.loads((tmp_path / "plain.json").read_text())["results"][0]  # opt-in
    assert eval_bases.main(common + ["--method", "fd-online", "--rank", "9"]) == 2
    assert "head_dim 8" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ τ calibration
TAU_OPTS = dict(rank_k=2, rank_v=2, ell=4, max_chunk_len=8, warmup=4)


def test_chunked_cache_records_no_residuals_by_default():
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    off = ChunkedCache(1, 2, 8, 1, rank_k=2, max_chunk_len=8, warmup=4)
    on = ChunkedCache(1, 2, 8, 1, rank_k=2, max_chunk_len=8, warmup=4, record_residuals=True)
    for c in (off, on):
        c.append(0, k=k, v=v)
    assert all(x.numel() == 0 for x in off.recorded_residuals())
    rk, rv = on.recorded_residuals(0)
    assert rk.numel() == rv.numel() == 2 * 16  # 2 KV heads × the 16 tokens after the warm-up
    assert torch.equal(off.reconstruct(0)[0], on.reconstruct(0)[0])  # recording changes nothing
    assert torch.allclose(rk.max(), on.residual_maxima(0)[0].max())


@pytest.mark.parametrize("relative", [False, True])
def test_calibrate_thresholds_percentile_100_is_the_max_and_closes_only_at_L(models, relative):
    model, ids = models["llama"], _ids(b=2, t=60, seed=3)
    cal = calibrate_thresholds(model, ids, percentile=100, relative=relative, tau_k=0.0, **TAU_OPTS)
    assert cal["percentile"] == 100 and cal["n_tokens"] == 120 and cal["n_residuals"] > 0
    rec = OnlineDecoder(model, relative=relative, record_residuals=True, **TAU_OPTS)
    cache = rec.new_cache(2)
    rec(ids, cache)
    rk, rv = cache.recorded_residuals()
    assert cal["tau_k"] == float(rk.max()) and cal["tau_v"] == float(rv.max())
    assert rk.numel() == cal["n_residuals"] == 2 * 2 * 2 * (60 - 4)  # layers × batch × KV heads × tokens after W
    dec = OnlineDecoder(model, relative=relative, tau_k=cal["tau_k"], tau_v=cal["tau_v"], **TAU_OPTS)
    cache = dec.new_cache(2)
    dec(ids, cache)
    for l in range(2):  # warm-up chunk, then only max_chunk_len closes: no τ close on the calibration text
        assert all(lens == [4] + [8] * 7 for lens in cache.chunk_lengths(l))


def test_calibrate_thresholds_lower_percentile_more_chunks(models):
    model, ids = models["llama"], _ids(b=2, t=60, seed=3)
    cals = {p: calibrate_thresholds(model, [ids[:1], ids[1:]], percentile=p, **TAU_OPTS) for p in (100, 50)}
    assert cals[50]["tau_k"] < cals[100]["tau_k"] and cals[50]["tau_v"] < cals[100]["tau_v"]
    assert cals[50]["n_tokens"] == 120

    def n_chunks(cal):
        dec = OnlineDecoder(model, tau_k=cal["tau_k"], tau_v=cal["tau_v"], **TAU_OPTS)
        cache = dec.new_cache(2)
        dec(ids, cache)
        return sum(sum(cache.num_chunks(l)) for l in range(2))

    assert n_chunks(cals[50]) > n_chunks(cals[100]) == 2 * 2 * 2 * 8
    with pytest.raises(ValueError, match="warm-up"):
        calibrate_thresholds(model, ids[:, :4], percentile=90, **TAU_OPTS)
    with pytest.raises(ValueError, match="percentile"):
        calibrate_thresholds(model, ids, percentile=101, **TAU_OPTS)


def test_eval_bases_cli_tau_percentile(tmp_path, capsys):
    """``--method fd-online --tau-percentile P --tau-calib PATH`` on a tiny saved random Llama: τ calibrated,
    printed and used; a clear one-line error without ``--tau-calib``."""
    tok_bin = STORIES / "tok512.bin"
    if not tok_bin.is_file():
        pytest.skip(f"{tok_bin} not found")
    from kvsplice.convert import llama2c as conv
    from kvsplice.cli import eval_bases

    torch.manual_seed(0)
    model = _sharpen(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256)))
    d = tmp_path / "llama"
    model.save_pretrained(d)
    conv.build_tokenizer(*conv.read_llama2c_tokenizer(tok_bin)[:2]).save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    words = "the cat dog sun ran saw big little happy tree park ball friend day mom said played jumped".split()
    for name in ("data", "calib"):
        stories = [" ".join(words[i] for i in torch.randint(0, len(words), (80,), generator=g)) + "."
                   for _ in range(12)]
        (tmp_path / f"{name}.txt").write_text("\n\n".join(stories), encoding="utf-8")
    common = ["--model", str(d), "--data", str(tmp_path / "data.txt"), "--tokens", "256", "--seq-len", "64",
              "--batch-size", "2", "--err-windows", "1", "--no-progress", "--method", "fd-online", "--rank", "2",
              "--max-chunk-len", "8", "--warmup", "4", "--tau-percentile", "90"]
    capsys.readouterr()
    rc = eval_bases.main(common + ["--tau-calib", str(tmp_path / "calib.txt"), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "90th percentile" in out and "τ_k = " in out and "τ@p90" in out
    r = json.loads((tmp_path / "r.json").read_text())["results"][0]
    cal = r["tau_calibration"]
    assert cal["percentile"] == 90 and cal["n_tokens"] == 256 and cal["source"].endswith("calib.txt")
    assert r["config"]["tau_k"] == cal["tau_k"] > 0 and r["config"]["tau_v"] == cal["tau_v"] > 0
    assert max(max(j) for j in r["chunks"]) > 1 + 64 // 8  # τ closes on top of the max_chunk_len ones
    assert eval_bases.main(common) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--tau-percentile needs --tau-calib" in err
