"""The pieces of a Llama-family → MLA fit: the complex RoPE split (kvsplice.convert.rope_split), the attention-weighted
latent (latent_fit), attention's distances (distance), the layer-local correction (refine), the measured cache split
of ``--ratio`` (cache_split), and ``kvsplice to-mla --ratio`` on stories260K.

* keys whose KV heads differ per frequency by a complex factor (a phase and a scale) keep all their positional
  information in one shared RoPE key: the conversion at full latent is the source model (a real rotation across
  heads, TransMLA's, is not);
* the weighted latent is exact at full rank and beats the unweighted one on the error it weighs;
* a distance profile at Δ = 0 leaves keys whole, a long uniform one fades high frequencies;
* the correction lowers a layer's output error; the measured split is sorted by its error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvsplice.cli import to_mla
from kvsplice.convert.cache_split import choose_split, rope_candidates, split_cache
from kvsplice.convert.distance import damping_map, distance_profile
from kvsplice.convert.latent_fit import attention_weights, fit_latent
from kvsplice.convert.llama_mla import (FitOptions, calibrate_layers, check_convertible, convert_llama, full_latent,
                                        output_error, refine_layers)
from kvsplice.convert.rope_split import shared_split
from kvsplice.loading import load_model
from hostile import one_error, run_tool
from tiny_models import tiny_family

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"


def _phased_heads(model, seed: int = 0) -> None:
    """Make KV head 1's key pairs a per-frequency complex multiple (phase, scale) of KV head 0's in every layer."""
    a = check_convertible(model)
    d, half = a.head_dim, a.head_dim // 2
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in a.m.layers:
            w = layer.self_attn.k_proj.weight  # (Hkv·D, d_model)
            phi = torch.rand(half, generator=gen) * 2 * math.pi
            rho = 0.5 + torch.rand(half, generator=gen)
            k1, k2 = w[:half], w[half:d]  # head 0's pair components
            w[d:d + half] = rho[:, None] * (phi.cos()[:, None] * k1 - phi.sin()[:, None] * k2)
            w[d + half:2 * d] = rho[:, None] * (phi.sin()[:, None] * k1 + phi.cos()[:, None] * k2)


@pytest.fixture(scope="module")
def phased():
    torch.manual_seed(0)
    model = tiny_family("llama")
    _phased_heads(model)
    calib = torch.randint(3, 90, (4, 32), generator=torch.Generator().manual_seed(1))
    held = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(2))
    return model, calibrate_layers(model, [calib], keep_windows=2), held


def test_complex_shared_split_keeps_phased_heads_exactly(phased):
    model, stats, held = phased
    a = check_convertible(model)
    full = full_latent(a.n_kv_head, a.head_dim, a.head_dim, "shared", a.d_model)
    mla = convert_llama(model, stats, d_latent=full, rope_dims=a.head_dim, layout="shared",
                        fit=FitOptions(damping=(False,), alphas=(1.0,)))
    want = model(input_ids=held).logits
    assert torch.allclose(mla(held), want, atol=1e-4, rtol=0), (mla(held) - want).abs().max()
    st = stats[0]  # the one complex component per frequency carries every key: nothing is left without RoPE
    split = shared_split(st.kk, st.qq, a.n_head, a.n_kv_head, a.head_dim, a.head_dim)
    assert float((split.residual() @ st.kk @ split.residual().T).trace()) < 1e-8 * float(st.kk.trace())


def test_old_real_rotation_is_not_exact_on_phased_heads(phased):
    """The same keys through a real top eigenvector per frequency (TransMLA's RoRoPE) lose energy to the no-RoPE
    part: what the complex split exists for."""
    model, stats, _ = phased
    a = check_convertible(model)
    st, d, half = stats[0], a.head_dim, a.head_dim // 2
    lost = 0.0
    for f in range(half):
        idx = torch.tensor([f, d + f, f + half, d + f + half])
        g = st.kk[idx][:, idx]
        g2 = g[:2, :2] + g[2:, 2:]  # both components alike: real Gram across the two heads
        lost += float(torch.linalg.eigvalsh(g2)[0])
    assert lost > 1e-3 * float(st.kk.trace())


def test_weighted_latent_is_exact_at_full_rank_and_better_where_it_weighs():
    gen = torch.Generator().manual_seed(0)
    d, kvd, n_head, n_kv, hd = 24, 16, 4, 2, 8
    x = torch.randn(400, d, generator=gen, dtype=torch.float64) @ torch.randn(d, d, generator=gen,
                                                                                dtype=torch.float64)
    xx = x.T @ x
    mk, wv = (torch.randn(kvd, d, generator=gen, dtype=torch.float64) for _ in range(2))
    wq = torch.randn(n_head * hd, d, generator=gen, dtype=torch.float64)
    wo = torch.randn(d, n_head * hd, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, n_head * hd)
    sk, sv = attention_weights(wq @ xx @ wq.T, wo, n_head, n_kv, hd, hd ** -0.5)
    down, w_uk, w_uv, _ = fit_latent(mk, wv, xx, 2 * kvd, sk=sk, sv=sv)
    assert torch.allclose(w_uk @ down, mk, atol=1e-8) and torch.allclose(w_uv @ down, wv, atol=1e-8)

    def weighted_value_error(rank, weighted):
        down, w_uk, w_uv, _ = fit_latent(mk, wv, xx, rank, sk=sk if weighted else None, sv=sv if weighted else None,
                                         alpha_mult=1e-3)  # keys nearly free: the values' fit decides
        e = (w_uv @ down - wv)
        return float(torch.trace(sv @ e @ xx @ e.T))

    assert weighted_value_error(6, True) < weighted_value_error(6, False)


def test_damping_keeps_zero_distance_and_fades_fast_frequencies():
    hd = 8
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    at_zero = torch.zeros(2, 64, dtype=torch.float64)
    at_zero[:, 0] = 1
    assert torch.allclose(damping_map(at_zero, inv, hd), torch.eye(2 * hd, dtype=torch.float64))
    uniform = torch.full((1, 64), 1 / 64, dtype=torch.float64)  # distances 0..63
    m = damping_map(uniform, inv, hd)
    assert torch.hypot(m[0, 0], m[4, 0]) < 0.05 and m[3, 3] > 0.95  # pair 0 (θ = 1) fades, pair 3 (θ = 1e-3) stays


def test_distance_profile_is_a_distribution_over_causal_distances(phased):
    model, stats, _ = phased
    a = check_convertible(model)
    p = distance_profile(a, 0, [x for x, _ in stats[0].windows])
    assert p.shape == (a.n_kv_head, 32) and torch.allclose(p.sum(-1), torch.ones(a.n_kv_head, dtype=p.dtype))
    assert (p >= 0).all() and p[:, 0].min() > 0  # every query sees itself


def test_refine_lowers_each_layers_output_error(phased):
    model, stats, held = phased
    mla = convert_llama(model, stats, d_latent=6, rope_dims=8, layout="shared")
    before = [output_error(b.attn, s.windows) for b, s in zip(mla.layers, stats)]
    res = refine_layers(mla, stats, steps=30, lr=3e-3)
    after = [output_error(b.attn, s.windows) for b, s in zip(mla.layers, stats)]
    assert all(r.after < r.before for r in res)
    assert all(y < x for x, y in zip(before, after))


def test_measured_alphas_and_damping_never_lose_to_the_default_alone(phased):
    model, stats, _ = phased
    fixed = convert_llama(model, stats, d_latent=6, rope_dims=8, layout="shared",
                          fit=FitOptions(damping=(False,), alphas=(0.5,)))
    measured = convert_llama(model, stats, d_latent=6, rope_dims=8, layout="shared")
    for f, m, s in zip(fixed.layers, measured.layers, stats):
        assert output_error(m.attn, s.windows) <= output_error(f.attn, s.windows) + 1e-9


def test_cache_split_candidates_and_measured_order(phased):
    assert split_cache(2, 3, 64) == 192 and split_cache(4, 3, 64) == 96 and split_cache(8, 3, 64) == 48
    with pytest.raises(ValueError, match="> 1"):
        split_cache(1.0, 3, 64)
    model, stats, _ = phased
    a = check_convertible(model)
    full = lambda dr: full_latent(a.n_kv_head, a.head_dim, dr, "shared", a.d_model)  # noqa: E731
    cands = rope_candidates(split_cache(4, a.n_kv_head, a.head_dim), a.head_dim, full)  # 16: D = 16 leaves none
    assert [c.rope_dims for c in cands] == [8, 4] and all(c.rope_dims + c.d_latent == 16 for c in cands)
    kept = rope_candidates(16, a.head_dim, full, keep=0.5)
    assert all(round(c.convert_latent * 0.5) == c.d_latent for c in kept)
    best, mla = choose_split(model, stats, cands, FitOptions())
    errs = [c.error for c in best]
    assert errs == sorted(errs) and all(e >= 0 for e in errs)
    assert (mla.cfg.rope_dims, mla.cfg.d_latent) == (best[0].rope_dims, best[0].convert_latent)
    got = sum(output_error(b.attn, s.windows) for b, s in zip(mla.layers, stats)) / len(stats)
    assert got == pytest.approx(best[0].error)


@pytest.fixture(scope="module")
def s260k(tmp_path_factory):
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip(f"needs the shared stories260K model ({STORIES})")
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))


@pytest.mark.parametrize("ratio,keep,want_cache", [(2, None, 32), (4, 0.5, 16)])
def test_cli_ratio_converts_to_the_asked_cache_and_exports(s260k, tmp_path, capsys, ratio, keep, want_cache):
    out, report = tmp_path / "mla", tmp_path / "report.json"
    argv = ["--model", str(s260k), "--calib", str(CALIB), "--calib-tokens", "2048", "--seq-len", "256",
            "--ratio", str(ratio), "--refine-steps", "3", "--out", str(out), "--json", str(report), "--no-progress"]
    if keep is not None:
        argv += ["--kvsplice-keep", str(keep)]
    assert to_mla.main(argv) == 0
    rep = json.loads(report.read_text())
    model = load_model(str(out)).model
    assert model.cfg.cache_dim == want_cache and rep["cache_dim"] == want_cache
    assert rep["compression_vs_source"] == pytest.approx(ratio)
    assert [c["output_error"] for c in rep["ratio_candidates"]] == sorted(c["output_error"]
                                                                          for c in rep["ratio_candidates"])
    ds = tmp_path / "ds"
    assert to_mla.main(["--model", str(out), "--format", "deepseek_v3", "--out", str(ds), "--no-progress"]) == 0
    again = load_model(str(ds)).model  # our own export reads back: the same model
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(again(ids), model(ids), atol=1e-3 * float(model(ids).abs().max()))


@pytest.mark.parametrize("extra,msg", [(["--d-latent", "8"], "leave out --d-latent"),
                                       (["--rope-layout", "per-head"], "shared RoPE layout"),
                                       (["--ratio", "1"], "> 1"), (["--ratio", "nan"], "> 1"),
                                       (["--refine-steps", "-1"], "whole number"),
                                       (["--ratio", "64"], "leaves no latent")])
def test_cli_ratio_refusals_are_one_line(s260k, tmp_path, capsys, extra, msg):
    argv = ["--model", str(s260k), "--calib", str(CALIB), "--calib-tokens", "1024", "--seq-len", "256",
            "--out", str(tmp_path / "o"), "--no-progress"]
    if "--ratio" not in extra:
        argv += ["--ratio", "2"]
    rc, _, err = run_tool(to_mla.main, argv + extra, capsys)
    one_error(rc, err, "kvsplice to-mla", msg)
    assert not (tmp_path / "o").exists()


def test_cli_both_keep_spellings_are_refused_not_one_dropped(tmp_path, capsys):
    rc, _, err = run_tool(to_mla.main, ["--model", str(tmp_path / "m"), "--kvsplice-ratio", "0.5", "--kvsplice-keep",
                                        "0.25", "--out", str(tmp_path / "o")], capsys)
    one_error(rc, err, "kvsplice to-mla", "not allowed with")
    assert not (tmp_path / "o").exists()


def test_cli_calib_self_calibrates_on_the_sources_own_text_sampled_once(s260k, tmp_path, capsys, monkeypatch):
    """``--calib self``: the source writes its calibration text (no file given), cached where ``kvsplice distill``
    caches it; a second conversion reads the cache (the file is not rewritten) and gives the same model."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["--model", str(s260k), "--calib", "self", "--calib-tokens", "512", "--seq-len", "128", "--ratio", "2",
            "--refine-steps", "2", "--no-progress"]
    assert to_mla.main(argv + ["--out", str(tmp_path / "a"), "--json", str(tmp_path / "a.json")]) == 0
    corpus = list((tmp_path / "cache" / "kvsplice" / "self_text").glob("self-*.safetensors"))
    assert len(corpus) == 1
    rep = json.loads((tmp_path / "a.json").read_text())
    assert rep["calibration_source"] == ["self"] and rep["calibration_tokens"] == 512
    written = corpus[0].stat().st_mtime_ns
    assert to_mla.main(argv + ["--out", str(tmp_path / "b")]) == 0
    assert corpus[0].stat().st_mtime_ns == written
    a, b = load_model(str(tmp_path / "a")).model, load_model(str(tmp_path / "b")).model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_cli_calib_self_needs_a_source_that_writes(tmp_path, capsys):
    from hostile import tiny_ckpt

    ckpt = tiny_ckpt(tmp_path / "t.ckpt", tmp_path / "c")
    rc, _, err = run_tool(to_mla.main, ["--model", str(ckpt), "--calib", "self", "--d-latent", "8",
                                        "--out", str(tmp_path / "o.ckpt")], capsys)
    one_error(rc, err, "kvsplice to-mla", "--calib self is the source's own text")
    assert not (tmp_path / "o.ckpt").exists()


def test_calibration_ids_share_the_tokens_and_interleave_the_sources_window_by_window(s260k, tmp_path, monkeypatch):
    """``--calib self TEXT``: half the tokens each, alternating windows (the kept windows see both); one source is
    its own tokens as they come."""
    from kvsplice.convert.calib_text import calibration_ids
    from kvsplice.loading import iter_texts, token_stream

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    loaded = load_model(str(s260k))
    tok, hf = loaded.tokenizer, loaded.model
    text, _ = token_stream(iter_texts(str(CALIB)), tok, 256)
    own = calibration_ids(["self"], tok, 256, 64, model=hf, max_positions=loaded.max_positions)
    both = calibration_ids(["self", str(CALIB)], tok, 512, 64, model=hf, max_positions=loaded.max_positions)
    assert torch.equal(calibration_ids([str(CALIB)], tok, 256, 64), text)
    windows = both.view(-1, 64)  # (8, 64): self, text, self, text, ...
    assert torch.equal(windows[0::2].reshape(-1), own) and torch.equal(windows[1::2].reshape(-1), text)
    with pytest.raises(ValueError, match="give each text once"):
        to_mla.ToMLAOptions(model="m", out="o", calib=("self", "self"))


def test_cli_calib_self_of_a_converted_model_is_one_line(s260k, tmp_path, capsys):
    """A converted folder writes no text (no ``generate``): ``--kvsplice-keep --calib self`` is refused by the
    self-text source itself, naming the way out."""
    mla = tmp_path / "mla"
    assert to_mla.main(["--model", str(s260k), "--calib", str(CALIB), "--calib-tokens", "512", "--seq-len", "128",
                        "--ratio", "2", "--refine-steps", "0", "--out", str(mla), "--no-progress"]) == 0
    rc, _, err = run_tool(to_mla.main, ["--model", str(mla), "--kvsplice-keep", "0.5", "--calib", "self",
                                        "--out", str(tmp_path / "o"), "--no-progress"], capsys)
    one_error(rc, err, "kvsplice to-mla", "cannot generate text (not a transformers causal LM); give --calib TEXT")
    assert not (tmp_path / "o").exists()
