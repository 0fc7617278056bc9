"""Engines: the DeepSeek-V3 export of a converted model in llama.cpp (kvsplice.convert.engines.llama_cpp, kvsplice.to_gguf).

Without llama.cpp (always run):
* a **norm-free** converted model exports with the latent RMSNorm in its linear regime: plain transformers gives
  our logits (1e-4, fp32) — the export is as good as the norm-free conversion;
* the config has what llama.cpp's loader needs (no ``n_group`` / ``topk_group``: ``n_expert_groups < n_expert``),
  ``tokenizer_config.json`` names a class transformers 4.x and 5.x both have;
* the post-step adds ``deepseek2.attention.q_lora_rank = 0`` to a ``deepseek2`` GGUF (gguf-py), tensors unchanged.

With llama.cpp (marker ``engines``; skipped with a one-line reason when ``$KVSPLICE_LLAMA_CPP`` /
``build/engines/llama.cpp`` is absent): a tiny Llama with SmolLM2's tokenizer (llama.cpp's DeepSeek converter takes
GPT-2-style BPE vocabularies only), converted (shared RoPE, latent 16 + 16 RoPE) and exported, through llama.cpp's
own ``convert_hf_to_gguf.py`` + the post-step: our ``Decoder``, transformers and llama.cpp give the same 64 greedy
tokens and perplexity within 0.5 %, and llama.cpp's f16 KV cache per token equals our measured f16 cache.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from kvsplice.convert.deepseek_v3 import deepseek_v3_config, portable_tokenizer_config, save_deepseek_v3
from kvsplice.convert.llama_mla import calibrate_layers, convert_llama
from kvsplice.convert.engines import gguf_convert, llama_cpp
from tiny_models import load_benchmark, tiny_family

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
SMOL = DATA / "smollm2-135m-instruct"
STORIES = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_llama():
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(3, 90, (4, 24), generator=gen)
    held = torch.randint(3, 90, (2, 20), generator=gen)
    m = tiny_family("llama")
    return m, calibrate_layers(m, [calib]), held


@pytest.mark.parametrize("d_latent", [20, None])
def test_norm_free_export_is_our_model_in_transformers(tiny_llama, tmp_path, d_latent):
    src, stats, held = tiny_llama
    mla = convert_llama(src, stats, d_latent=d_latent, rope_dims=16, layout="shared")
    assert not mla.cfg.latent_norm
    save_deepseek_v3(mla, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["n_group"] is None and cfg["topk_group"] is None and cfg["n_routed_experts"] == 1
    assert cfg["rms_norm_eps"] == 1e-6 and "linear regime" in cfg["kvsplice"]["latent_norm"]
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]  # transformers 4.x reads the first
    ds = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert (ds(held).logits - mla(held)).abs().max() <= TOL
    assert (mla(held) - src(held).logits).abs().max() > 0.05 or d_latent is None  # lossy at 20: the test can tell


@pytest.mark.parametrize("latent_norm", [False, True])
def test_padded_export_is_exact(tiny_llama, tmp_path, latent_norm):
    """vLLM's MLA takes latent + RoPE of 320 / 512 / 576 only, its CPU kernel 512 + 64: padding the latent through
    its RMSNorm (linear regime or a real norm) and spreading the RoPE pairs keeps the model (fp32, ≤ 1e-4)."""
    src, stats, held = tiny_llama
    mla = convert_llama(src, stats, d_latent=20, rope_dims=16, layout="shared", latent_norm=latent_norm)
    save_deepseek_v3(mla, tmp_path, pad_latent=48, pad_rope=64)
    ds = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert (ds.config.kv_lora_rank, ds.config.qk_rope_head_dim) == (48, 64)
    assert (ds(held).logits - mla(held)).abs().max() <= TOL
    with pytest.raises(ValueError, match="multiple of the RoPE key"):
        save_deepseek_v3(mla, tmp_path / "x", pad_rope=24)
    with pytest.raises(ValueError, match="smaller than the latent"):
        save_deepseek_v3(mla, tmp_path / "y", pad_latent=8)


def test_latent_norm_eps(tiny_llama):
    """A real latent norm keeps transformers' fixed kv_a_layernorm eps (1e-6) and the source's rms_norm_eps for the
    other norms (transformers: exact); the linear regime writes one eps, 1e-6, for every engine."""
    src, stats, _ = tiny_llama
    mla = convert_llama(src, stats, d_latent=20, rope_dims=16, layout="shared", latent_norm=True)
    assert mla.cfg.latent_norm_eps == mla.layers[0].attn.kv_norm.eps == 1e-6
    assert deepseek_v3_config(mla)["rms_norm_eps"] == src.config.rms_norm_eps
    free = convert_llama(src, stats, d_latent=20, rope_dims=16, layout="shared")
    assert deepseek_v3_config(free)["rms_norm_eps"] == 1e-6


def test_tokenizer_config_is_portable(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", "x": 1}))
    portable_tokenizer_config(tmp_path)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tc == {"tokenizer_class": "PreTrainedTokenizerFast", "x": 1}


def test_post_step_adds_q_lora_rank(tmp_path):
    gguf = gguf_convert.gguf_module()
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), arch="deepseek2")
    w.add_block_count(2)
    w.add_kv_lora_rank(16)
    w.add_token_list(["a", "b"])
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    w.add_tensor("blk.0.attn_kv_a_mqa.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_convert.fix_gguf(path) == [llama_cpp.Q_LORA_KEY]
    r = gguf.GGUFReader(str(path))
    assert r.get_field(llama_cpp.Q_LORA_KEY).contents() == 0
    assert r.get_field("deepseek2.attention.kv_lora_rank").contents() == 16
    assert r.get_field("tokenizer.ggml.tokens").contents() == ["a", "b"]
    assert np.array_equal(np.asarray(r.tensors[0].data).reshape(3, 4), data)
    del r
    assert gguf_convert.fix_gguf(path) == []  # nothing missing: untouched


def test_llama_cpp_root_follows_the_env(monkeypatch, tmp_path):
    monkeypatch.setenv(llama_cpp.ENV, str(tmp_path / "nowhere"))
    assert llama_cpp.llama_cpp_root() == tmp_path / "nowhere"
    why = llama_cpp.missing()
    assert why.startswith("llama.cpp not found at") and "\n" not in why
    monkeypatch.delenv(llama_cpp.ENV)
    assert llama_cpp.llama_cpp_root() == llama_cpp.REPO / "build" / "engines" / "llama.cpp"


# ------------------------------------------------------------------------------------------------ llama.cpp itself
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    why = llama_cpp.missing(bindings=True)
    if why:
        pytest.skip(why)
    if not (SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() or not STORIES.is_file():
        pytest.skip(f"SmolLM2 GGUF (its tokenizer) / TinyStories not found under {DATA}")
    tok = transformers.AutoTokenizer.from_pretrained(str(SMOL), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=512,
                                   initializer_range=0.2)
    src = transformers.LlamaForCausalLM(cfg).eval()
    text = STORIES.read_text()[:20000]
    ids = tok(text)["input_ids"]
    stats = calibrate_layers(src, [torch.tensor(ids[:2048]).view(8, 256)])
    mla = convert_llama(src, stats, d_latent=16, rope_dims=16, layout="shared")
    root = tmp_path_factory.mktemp("engines")
    save_deepseek_v3(mla, root / "ds", tok)
    from kvsplice.cli import to_gguf

    assert to_gguf.main([str(root / "ds"), "--out", str(root / "m.gguf")]) == 0
    return mla, root, ids[2048:2048 + 256]


@pytest.mark.engines
def test_llama_cpp_equals_ours_and_transformers(exported):
    from kvsplice.decode import Decoder
    from kvsplice.report.memory import measure_cache

    mla, root, held = exported
    ds = transformers.AutoModelForCausalLM.from_pretrained(root / "ds", dtype=torch.float32).eval()
    ids = torch.tensor([held])

    def ppl(logits) -> float:
        return math.exp(torch.nn.functional.cross_entropy(torch.as_tensor(logits)[:-1].float(), ids[0, 1:]).item())

    with llama_cpp.LlamaCppModel(root / "m.gguf", n_ctx=8192, cache_type="f16") as lm:
        p_cpp = ppl(lm.logits(held))
        g_cpp = lm.greedy(held[:8], 64)
        cpp_bytes = lm.kv_bytes_per_token
        assert lm.kv_cache()["v_mib"] == 0.0  # a true latent cache: K only (latent + RoPE key), no V
    p_ours, p_hf = ppl(mla(ids)[0]), ppl(ds(ids).logits[0])
    assert abs(p_cpp / p_ours - 1) <= 0.005 and abs(p_hf / p_ours - 1) <= 0.005
    dec = Decoder(mla)
    g_ours = dec.generate(ids[:, :8], 64)[0, 8:].tolist()
    g_hf = ds.generate(ids[:, :8], max_new_tokens=64, do_sample=False)[0, 8:].tolist()
    assert g_ours == g_hf == g_cpp
    half = copy.deepcopy(mla).half()  # our f16 cache, measured from its tensors
    cache = half.new_cache(1, capacity=len(held))
    with torch.no_grad():
        half(ids, cache)
    ours_bytes = measure_cache(cache).live_bytes / len(held)
    assert ours_bytes == mla.cache_bytes_formula(1, 1, torch.float16) == 2 * (16 + 16) * 2
    assert round(cpp_bytes, 3) == ours_bytes


@pytest.mark.engines
@pytest.mark.parametrize("config, fmt, numbers", [("tiny_ds_mla_kvsplice_90", "deepseek_v3", 6 + 8),
                                                   ("tiny_ds_mha", "llama", 2 * 128)])
def test_trained_deepseek_layout_runs_unchanged_in_llama_cpp(tmp_path, data_cache, offline, capsys, config, fmt,
                                                             numbers):
    """The trained family's goal: ``training.fit --config tiny_ds_mla_kvsplice_90`` (a short real run,
    its own trained BPE tokenizer), ``training.export --format deepseek_v3``, llama.cpp's converter (``to_gguf``) —
    no edits — then our cached decode, transformers and llama.cpp give the same 64 greedy tokens, perplexity within
    0.5 %, and llama.cpp's f16 KV bytes per token equal ours (latent 6 + RoPE key 8, 4 layers). The same for the
    standard-attention baseline, exported as a Llama (K and V, 2 x 128 numbers per layer). (``engines_vllm
    --engines llama.cpp``.)"""
    why = llama_cpp.missing(bindings=True)
    if why:
        pytest.skip(why)
    from training.fit import main as fit

    rc = fit(["--config", config, "--trainer.max_steps", "30", "--trainer.val_check_interval", "30",
              "--data.synthetic_stories", "2000", "--data.synthetic_vocab_size", "512", "--data.batch_size", "8",
              "--data.val_batches", "2", "--data.cache_dir", str(data_cache), "--runs_dir", str(tmp_path),
              "--wandb.mode", "disabled", "--trainer.enable_progress_bar", "false"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    bench = load_benchmark("engines_vllm")
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. " * 4
    out = bench.trained_in_engines(tmp_path / config / "last.ckpt", text, tokens=96, new=64, work=tmp_path / "eng",
                        engines=["llama.cpp"])
    assert out["model"]["format"] == fmt and out["tokens"] == 96 and "vllm" not in out
    assert out["greedy"]["llama.cpp"] == out["greedy"]["ours"] == out["greedy"]["transformers"], out["greedy"]
    p = out["perplexity"]
    assert max(abs(v / p["ours"] - 1) for v in p.values()) <= 0.005, p
    kv = out["model"]["kv_bytes_per_token_f16"]
    assert kv["ours"] == kv["formula"] == 4 * numbers * 2
    assert abs(out["llama_cpp"]["kv_bytes_per_token_f16"] - kv["ours"]) <= out["llama_cpp"]["rounding"]


def test_to_gguf_never_writes_a_file_of_its_input_folder(tmp_path, capsys):
    """``to_gguf DIR --out DIR/model.safetensors --force``: refused in one line before any work, the input intact."""
    from kvsplice.cli import to_gguf

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    weights = folder / "model.safetensors"
    weights.write_bytes(b"weights")
    assert to_gguf.main([str(folder), "--out", str(weights), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "input" in err
    assert weights.read_bytes() == b"weights" and sorted(p.name for p in folder.iterdir()) == ["config.json",
                                                                                             "model.safetensors"]


@pytest.mark.parametrize("study, stem, values", [
    ("engine_serving", "engine_serving", {"budget_gib": 4.0, "llama_max_seq": 256}),
    ("engines_smollm2", "engines_smollm2_tuned2x", {"eval_tokens": 2048, "greedy": 32})])
def test_engine_reports_in_yaml_render_the_committed_tables(study, stem, values):
    """The ``report:`` of engine_serving's and engines_smollm2's YAML renders their committed rows as the committed
    tables (the flags as yes / no, a missing cell empty or ``—``, only the ``-fa`` columns that were run)."""
    from benchmarks.harness import report, studies

    results = Path(__file__).resolve().parents[3] / "results"
    rows = json.loads((results / f"{stem}.json").read_text())["rows"]
    md = report.markdown(studies.load(study)["report"], rows, values).rstrip("\n")
    assert (results / f"{stem}.md").read_text().startswith(md + "\n") and md.count("\n") == len(rows) + 1


@pytest.mark.engines
def test_engine_serving_capacity_is_llama_cpps_own_bytes(tmp_path):
    """``benchmarks/engine_serving.py`` in miniature (2-layer random models, 64-token sequences, a 16 MiB budget):
    llama.cpp's own f16 KV bytes per token are the formula (standard: 2 x d per layer; MLA: latent + 64-dim RoPE key,
    no V), the sequences that fit are budget // (bytes x context), the batch run is capped at llama.cpp's
    LLAMA_MAX_SEQ, and batched-bench decodes at that batch with -fa on and off (2 repeats each), the faster kept."""
    why = llama_cpp.missing(bindings=True, programs=("llama-batched-bench",))
    if why:
        pytest.skip(why)
    if not (DATA / "gpt2_tokenizer" / "encoder.json").is_file():
        pytest.skip(f"GPT-2 tokenizer files not found under {DATA}")
    bench = load_benchmark("engine_serving")
    out = tmp_path / "serving"
    budget = 2.0 ** -6  # GiB
    assert bench.main(["--shape", "tiny", "--latents", "std", "26", "--ctx", "64", "--ntg", "1", "--repeats", "2",
                       "--budget-gib", str(budget), "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    std, mla = doc["rows"]
    assert std["kv_bytes_per_token_f16"] == 2 * 2 * 128 * 2          # layers x (K + V) x d x 2 bytes
    assert round(mla["kv_bytes_per_token_f16"]) == 2 * (26 + 64) * 2  # layers x (latent + RoPE key) x 2 bytes
    assert mla["kv_log"]["v_mib"] == 0.0
    for r in (std, mla):
        assert r["max_parallel_sequences"] == int(budget * 2 ** 30 // (r["kv_bytes_per_token_f16"] * 64))
        assert r["batch"] == min(r["max_parallel_sequences"], llama_cpp.max_sequences())
        assert len(r["batched_bench"]) == 2 * 2 and {b["pl"] for b in r["batched_bench"]} == {r["batch"]}
        assert r["decode_tps_at_batch"] == r["decode_tps"][r["best_fa"]] == max(r["decode_tps"].values()) > 0
    assert mla["capacity_vs_standard"] == mla["max_parallel_sequences"] / std["max_parallel_sequences"]
    assert "| KVSplice-90: 26 + 64 | 64 | 360 |" in out.with_suffix(".md").read_text()
