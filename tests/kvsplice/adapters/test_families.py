"""The model families beyond Llama and GPT-2 (Mistral, Qwen2, Qwen3, Phi-3, Gemma-3): tiny random-weight models built
from their transformers configs (no download), with sliding windows shorter than the prompts.

* Full cache, full rank (post- and pre-RoPE) and full budget give transformers' own logits (1e-5, fp32) and greedy
  tokens, in the package's ``Decoder`` and inside ``generate()`` (left-padded batches included); the window is
  visible (attending past it changes the logits), so these tests can fail.
* Sliding-window layers hold only their last ``window - 1`` tokens (a token subset: the most recent ones) and lossy
  settings report measured bytes == formula in both doors.
* Every post-training command runs each family end to end (needs ../shared/data for a tokenizer and text); an
  unsupported family is one error line with exit status 2 from every command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from kvsplice.adapters import LlamaAdapter, adapter_for
from kvsplice.decode import Decoder, DenseKV
from kvsplice.hf import KVSpliceHFCache
from kvsplice.hf.attention import kvsplice_attention, tag
from kvsplice.lowrank.calibrate import calibrate
from kvsplice.lowrank.method import LowRank
from kvsplice.report.memory import measure_cache
from kvsplice.select.method import TokenSelection
from kvsplice.select.selectors import make_selector
from tiny_models import orthonormal_bases, save_model_dirs, tiny_family
from hostile import prog_of

FAMS = ["mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3"]
W = 5  # sliding window: every prompt below is longer
L, HKV, D = 3, 2, 16  # tiny_family's layers, KV heads, head dim
TOL = 1e-5
TEXT_IDS = 93  # token ids below this are text in every tiny model (gemma3 keeps 93-95 for images)


@pytest.fixture(scope="module")
def models():
    return {fam: tiny_family(fam, window=W) for fam in FAMS}


def lossless(rope_pre: bool = True):
    """Every method at a setting where it must reproduce the model."""
    out = {"dense": DenseKV(), "rank-full-post": LowRank(orthonormal_bases(L, HKV, D, D, "post")),
           "budget-full": TokenSelection(make_selector("balancekv"), 64),
           "budget-full-rank-full": TokenSelection(make_selector("knorm"), 64,
                                                   store=LowRank(orthonormal_bases(L, HKV, D, D, "post", seed=1)))}
    if rope_pre:
        out["rank-full-pre"] = LowRank(orthonormal_bases(L, HKV, D, D, "pre", seed=2))
        out["rank-full-pre-naive"] = LowRank(orthonormal_bases(L, HKV, D, D, "pre", seed=2), impl="naive")
    return out


def windows_of(model):
    return [adapter_for(model).window(l) for l in range(L)]


def test_adapters_and_windows(models):
    expect = {"mistral": [W] * 3, "qwen2": [None, W, W], "qwen3": [None, W, W], "phi3": [W] * 3,
              "gemma3_text": [W, None, W], "gemma3": [W, None, W]}
    for fam, m in models.items():
        a = adapter_for(m)
        assert a.name == fam and windows_of(m) == expect[fam]
        assert (a.n_layer, a.n_kv_head, a.head_dim) == (L, HKV, D)
    assert type(adapter_for(models["mistral"])) is LlamaAdapter  # Mistral and Qwen2 need no adapter of their own
    assert type(adapter_for(models["qwen2"])) is LlamaAdapter
    g = adapter_for(models["gemma3_text"])
    assert g.rotary_embedding(0) is g.rotary_embedding(2) is not g.rotary_embedding(1)  # local vs global RoPE base
    x = torch.zeros(1, 1, 1)
    cos_local, cos_global = g.rope(x, 7, 1, layer=0)[0], g.rope(x, 7, 1, layer=1)[0]
    assert not torch.allclose(cos_local, cos_global)


@pytest.mark.parametrize("fam", FAMS)
def test_decoder_equals_transformers_past_the_window(models, fam):
    model = models[fam]
    ids = torch.randint(3, TEXT_IDS, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits  # (B, T, V)
        ref_tokens = model.generate(ids[:1, :9], max_new_tokens=10, do_sample=False, pad_token_id=0)
    for name, method in lossless().items():
        dec = Decoder(model, method)
        cache = dec.new_cache(2)
        out = torch.cat([dec(ids[:, :9], cache), dec(ids[:, 9:10], cache), dec(ids[:, 10:], cache)], dim=1)
        assert (out - ref).abs().max() <= TOL, (fam, name, (out - ref).abs().max())
        assert torch.equal(dec.generate(ids[:1, :9], max_new_tokens=10), ref_tokens), (fam, name)


@pytest.mark.parametrize("fam", ["mistral", "gemma3"])
def test_the_window_is_visible(models, fam, monkeypatch):
    """Attending past the window changes the logits far above the tolerance: the tests above can fail."""
    model = models[fam]
    ids = torch.randint(3, TEXT_IDS, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    monkeypatch.setattr(LlamaAdapter, "window", lambda self, layer: None)
    dec = Decoder(model)
    assert (dec(ids, dec.new_cache(1)) - ref).abs().max() > 1e-2


def left_padded(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TEXT_IDS, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # the second row: 4 padding tokens, then 8 real (longer than the window)
    return ids, mask


def hf_generate(model, ids, mask, cache, n=10):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1)  # (B, T + n), (B, n, V)


@pytest.mark.parametrize("fam", FAMS)
def test_hf_door_equals_transformers_with_left_padding(models, fam):
    model = models[fam]
    ids, mask = left_padded()
    ref_seq, ref_scores = hf_generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    for name, method in lossless().items():
        cache = KVSpliceHFCache(model, method)
        seq, scores = hf_generate(model, ids, mask, cache)
        assert torch.equal(seq, ref_seq) and (scores - ref_scores).abs().max() <= TOL, (fam, name)
        w = windows_of(model)
        held = [cache.method_cache.layer_len(l) for l in range(L)]
        assert held == [W - 1 if wl else 12 + 9 for wl in w], (fam, name, held)  # 12 prompt + 9 decoded, fed
        assert measure_cache(cache).live_bytes == cache.nbytes() == cache.formula_nbytes(), (fam, name)
        model.set_attn_implementation("sdpa")


def lossy(pre: bool):
    bases = orthonormal_bases(L, HKV, D, 4, "pre" if pre else "post", seed=3)
    sel = TokenSelection(make_selector("balancekv"), 3)  # budget 3 < W - 1
    return {"rank-4": LowRank(bases), "rank-4-int8": LowRank(bases, cache_quant="int8"),
            "dense-int8": DenseKV(cache_quant="int8"), "budget-3": sel,
            "budget-3-rank-4-int8": TokenSelection(make_selector("knorm"), 3, store=LowRank(
                orthonormal_bases(L, HKV, D, 4, "post", seed=4), cache_quant="int8"))}


@pytest.mark.parametrize("fam", FAMS)
def test_lossy_settings_hold_their_window_and_bytes_match_the_formula(models, fam):
    model = models[fam]
    w = windows_of(model)
    ids = torch.randint(3, TEXT_IDS, (2, 14), generator=torch.Generator().manual_seed(2))
    for pre in (False, True):
        for name, method in lossy(pre).items():
            budget = getattr(method, "budget", None)
            dec = Decoder(model, method)
            cache = dec.new_cache(2)
            dec(ids[:, :10], cache)  # a prompt twice the window
            for t in range(10, 14):
                dec(ids[:, t:t + 1], cache)
                seen = t + 1
                full = seen if budget is None else min(budget, 10) + seen - 10  # a subset: budget + the decoded
                expect = [min(W - 1, seen if budget is None else min(budget, W - 1) + seen - 10) if wl else full
                          for wl in w]
                assert [cache.layer_len(l) for l in range(L)] == expect, (fam, name, t)
                assert measure_cache(cache).live_bytes == cache.nbytes() == dec.formula_nbytes(cache), (fam, name)
            hf = KVSpliceHFCache(model, method)
            mask = torch.ones_like(ids)
            hf_generate(model, ids[:, :10], mask[:, :10], hf, n=5)
            assert measure_cache(hf).live_bytes == hf.nbytes() == hf.formula_nbytes(), (fam, name)
            assert all(hf.method_cache.layer_len(l) <= W - 1 for l in range(L) if w[l])
            model.set_attn_implementation("sdpa")


def test_a_windowed_subset_is_the_windows_most_recent_tokens(models):
    """Budget 3 < window - 1 on a windowed layer: the kept keys are the last 3 of the prompt (never one from
    outside the window); full-attention layers keep the selector's choice."""
    model = models["gemma3_text"]
    ids = torch.randint(3, TEXT_IDS, (1, 12), generator=torch.Generator().manual_seed(3))
    dense, subset = Decoder(model, DenseKV()), Decoder(model, TokenSelection(make_selector("knorm"), 3))
    cd, cs = dense.new_cache(1), subset.new_cache(1)
    dense(ids, cd)
    subset(ids, cs)
    for layer in (0, 2):  # windowed
        assert torch.equal(cs.kept.get(layer)["k"], cd.get(layer)["k"][..., -3:, :])
    assert cs.layer_len(1) == 3


def test_phi3_partial_rotary_post_is_exact_and_pre_is_refused():
    model = tiny_family("phi3", window=W, partial_rotary=0.5)
    assert adapter_for(model).rotary_dim == D // 2
    ids = torch.randint(3, TEXT_IDS, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids).logits
    for method in lossless(rope_pre=False).values():
        dec = Decoder(model, method)
        assert (dec(ids, dec.new_cache(1)) - ref).abs().max() <= TOL
    with pytest.raises(ValueError, match="partial"):
        Decoder(model, LowRank(orthonormal_bases(L, HKV, D, D, "pre")))
    with pytest.raises(ValueError, match="partial"):  # refused before calibrating, too
        calibrate(model, [ids], rope="pre", progress=False)


def test_soft_capped_attention_is_refused(models):
    """Soft-capped scores (a softcap= to the attention function) are no method's: one clear error."""
    model = models["gemma3_text"]
    cache = KVSpliceHFCache(model, DenseKV())
    q, k = torch.zeros(1, 4, 1, D), torch.zeros(1, HKV, 1, D)
    with pytest.raises(ValueError, match="soft-capping"):
        kvsplice_attention(model.model.layers[0].self_attn, q, tag(k, cache, 0), k, None, softcap=50.0)
    model.set_attn_implementation("sdpa")


# --------------------------------------------------------------------------------------------- commands
DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"
EVAL = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
needs_data = pytest.mark.skipif(not all(p.is_file() for p in (STORIES / "stories260K.bin", CALIB, EVAL)),
                                reason=f"stories260K / TinyStories not found under {DATA}")
CLI_W = 8  # the commands' models: window 8, prompts and windows of text longer
PROMPT = "Once upon a time, there was a little girl who liked to play in the park with her dog"


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Each family (and an unsupported OLMo) saved with save_pretrained plus stories260K's 512-token tokenizer."""
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip("stories260K not found")
    from kvsplice.convert.llama2c import convert_llama2c

    s260k = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))
    tok = transformers.AutoTokenizer.from_pretrained(s260k)
    models = {fam: tiny_family(fam, window=CLI_W, vocab_size=520) for fam in FAMS}
    models["olmo"] = transformers.OlmoForCausalLM(transformers.OlmoConfig(
        vocab_size=520, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=128))
    return save_model_dirs(models, tok, tmp_path_factory)


def run(cli, args, capsys):
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    return (rc, *capsys.readouterr())


@needs_data
@pytest.mark.parametrize("fam", FAMS)
def test_every_command_runs_the_family_and_full_rank_is_lossless(family_dirs, fam, tmp_path, capsys):
    from kvsplice.cli import bench_balance, eval_bases, fit_bases, generate

    d = family_dirs[fam]
    files = {}
    for rope, rank in (("pre", D), ("post", 4)):
        files[rope] = tmp_path / f"{rope}.safetensors"
        rc, _, err = run(fit_bases, ["--model", d, "--method", "gqa-concat", "--rank", rank, "--rope", rope,
                                     "--calib", CALIB, "--calib-tokens", 1024, "--seq-len", 32, "--no-progress",
                                     "--out", files[rope]], capsys)
        assert rc == 0, err
    rc, _, err = run(eval_bases, ["--model", d, "--bases", files["pre"], files["post"], "--data", EVAL, "--tokens",
                                  512, "--seq-len", 32, "--no-progress", "--cache-quant", "int8", "--json",
                                  tmp_path / "eval.json"], capsys)
    assert rc == 0, err
    rep = json.loads((tmp_path / "eval.json").read_text())
    rows = {r["label"]: r for r in rep["results"]}
    full = rep["full"]["ppl"]
    assert abs(rows["pre"]["ppl"] / full - 1) < 1e-5 and abs(full / rep["full"]["model_forward_ppl"] - 1) < 1e-5
    assert rep["full"]["cache"]["bytes_match"] and all(r["cache"]["bytes_match"] for r in rep["results"])
    texts = {}
    for name, extra in (("full", []), ("pre", ["--bases", files["pre"]]), ("budget", ["--select", "balancekv",
                                                                                      "--budget", 512]),
                        ("rank-4", ["--bases", files["post"]]), ("budget-4", ["--select", "knorm", "--budget", 4])):
        rc, _, err = run(generate, ["--model", d, "--prompt", PROMPT, "--max-new-tokens", 12, "--json",
                                    tmp_path / f"{name}.json", *extra], capsys)
        assert rc == 0, err
        g = json.loads((tmp_path / f"{name}.json").read_text())
        assert len(g["prompt_tokens"]) > CLI_W and g["cache_bytes"] == (g["cache_bytes_formula"] or g["cache_bytes"])
        texts[name] = g["tokens"]
    assert texts["pre"] == texts["full"] == texts["budget"]
    rc, out, err = run(bench_balance, ["--model", d, "--data", EVAL, "--T", 1, "--seeds", 1, "--windows", 1,
                                       "--context", CLI_W, "--n-queries", 2, "--n-sink", 1, "--n-recent", 1,
                                       "--block-size", 2, "--markdown"], capsys)
    assert rc == 0, err
    assert "| layer |" in out


@needs_data
def test_unsupported_family_is_one_line_exit_2_everywhere(family_dirs, tmp_path, capsys):
    from kvsplice.cli import bench_balance, eval_bases, fit_bases, generate

    d, bases = family_dirs["olmo"], tmp_path / "b.safetensors"
    orthonormal_bases(1, 2, 16, 4, "post").save(bases)
    for prog, cli, args in (
            ("generate", generate, ["--prompt", "hi", "--max-new-tokens", 2]),
            ("fit_bases", fit_bases, ["--method", "ksvd", "--rank", 2, "--calib", CALIB, "--out",
                                      bases.with_suffix(".x")]),
            ("eval_bases", eval_bases, ["--bases", bases, "--data", EVAL]),
            ("bench_balance", bench_balance, ["--data", EVAL])):
        rc, _, err = run(cli, ["--model", d, *args], capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"{prog_of(prog)}: error: unsupported model"), err
        assert "gpt2, llama, mistral, qwen2, qwen3, phi3, gemma3_text" in lines[0]


@needs_data
@pytest.mark.parametrize("fam", FAMS)
def test_plan_and_loss_aware_bases_run_every_family(family_dirs, fam, tmp_path, capsys):
    """``plan`` and ``fit_bases --method fisher`` (both RoPE modes, one loss-gradient pass: Gemma-3's per-layer RoPE
    tables and Qwen3 / Gemma-3's key norms included), then the plan through ``eval_bases`` and ``generate``."""
    from kvsplice.cli import eval_bases, fit_bases, generate, plan

    d = family_dirs[fam]
    rc, _, err = run(fit_bases, ["--model", d, "--method", "fisher", "--rank", 4, "--rope", "pre", "post",
                                 "--calib", CALIB, "--calib-tokens", 256, "--seq-len", 32, "--no-progress",
                                 "--no-forward-timing", "--out", tmp_path / "f_{rope}.safetensors"], capsys)
    assert rc == 0, err
    assert (tmp_path / "f_pre.safetensors").is_file() and (tmp_path / "f_post.safetensors").is_file()
    p = tmp_path / "plan.json"
    rc, _, err = run(plan, ["--model", d, "--calib", CALIB, "--ratio", 4, "--calib-tokens", 256, "--tune-tokens", 64,
                            "--seq-len", 32, "--tune-tasks", "passkey", "--tune-length", 160, "--selectors", "knorm",
                            "--no-progress", "--out", p], capsys)  # passkey's prompts: up to 160 of the 256 positions
    assert rc == 0, err
    rc, _, err = run(eval_bases, ["--model", d, "--plan", p, "--data", EVAL, "--tokens", 128, "--seq-len", 32,
                                  "--no-progress", "--json", tmp_path / "e.json"], capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "e.json").read_text())["results"][0]["ppl"] > 1
    rc, _, err = run(generate, ["--model", d, "--plan", p, "--prompt", PROMPT, "--max-new-tokens", 4, "--json",
                                tmp_path / "g.json"], capsys)
    assert rc == 0, err
    assert len(json.loads((tmp_path / "g.json").read_text())["tokens"]) == 4
