"""Llama-family → MLA conversion (kvsplice.convert.llama_mla), the converted model (models.mla_llama), its folder
and the DeepSeek-V3 export (kvsplice.convert.deepseek_v3), and ``kvsplice to-mla`` on them.

* Full rank with every RoPE dim, per-head layout, norm-free: the source's logits (1e-4, fp32) for a tiny model of
  each convertible family (Mistral / Qwen2 with sliding windows shorter than the text) and stories260K;
* every converted model: cached decode == full forward, absorbed == naive, cache bytes measured == formula;
* KVSplice (PCA of the latent) == converting at the smaller rank; lower ranks / fewer RoPE dims cost loss;
* the DeepSeek-V3 folder loads in plain transformers with our logits and caches latent + RoPE dims per token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from kvsplice.cli import to_mla
from kvsplice.convert.deepseek_v3 import check_exportable, save_deepseek_v3
from kvsplice.convert.llama_mla import calibrate_layers, convert_llama, full_latent, latent_gram, shrink_latent
from kvsplice.decode import Decoder
from kvsplice.loading import load_model
from kvsplice.loading.mla_folder import load_mla_folder, save_mla_folder
from kvsplice.report.memory import measure_cache
from hostile import one_error, snapshot
from tiny_models import tiny_family

FAMS = ["llama", "mistral", "qwen2", "qwen3"]
TOL = 1e-4
DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"
SMOL = DATA / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny():
    """Each family (window 5 where it has one), calibration ids, held-out ids and the layer statistics."""
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(3, 90, (4, 24), generator=gen)
    held = torch.randint(3, 90, (2, 20), generator=gen)
    out = {}
    for fam in FAMS:
        m = tiny_family(fam, window=5 if fam in ("mistral", "qwen2") else None)
        out[fam] = (m, calibrate_layers(m, [calib]))
    return out, calib, held


def decode_in_steps(model, ids, impl):
    model.cfg.mla_impl = impl
    cache = model.new_cache(ids.shape[0])
    steps = [model(ids[:, :7], cache)] + [model(ids[:, j:j + 1], cache) for j in range(7, ids.shape[1])]
    model.cfg.mla_impl = "naive"
    return torch.cat(steps, 1), cache


@pytest.mark.parametrize("fam", FAMS)
def test_full_rank_per_head_conversion_is_the_source_model(tiny, fam):
    models, _, held = tiny
    src, stats = models[fam]
    mla = convert_llama(src, stats, d_latent=None, rope_dims=src.config.head_dim, layout="per-head")
    ref = src(held).logits
    assert (mla(held) - ref).abs().max() <= TOL
    for impl in ("naive", "absorb"):
        assert (decode_in_steps(mla, held, impl)[0] - ref).abs().max() <= TOL
    assert mla.cfg.cache_dim == 2 * 2 * 16  # as many numbers as the source's K and V


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("layout,rope_dims,norm", [("per-head", 4, False), ("shared", 8, True)])
def test_compressed_conversion_decodes_consistently(tiny, fam, layout, rope_dims, norm):
    models, _, held = tiny
    src, stats = models[fam]
    mla = convert_llama(src, stats, d_latent=12, rope_dims=rope_dims, layout=layout, latent_norm=norm)
    full = mla(held)
    naive, cache = decode_in_steps(mla, held, "naive")
    absorbed, _ = decode_in_steps(mla, held, "absorb")
    assert (naive - full).abs().max() <= TOL and (absorbed - naive).abs().max() <= TOL
    assert (full - src(held).logits).abs().max() > 0.05  # lossy: the test can tell
    assert measure_cache(cache).live_bytes == mla.cache_bytes_formula(2, held.shape[1], torch.float32)
    assert mla.cfg.cache_dim == 12 + (2 if layout == "per-head" else 1) * rope_dims


def test_more_rank_and_rope_dims_lose_less(tiny):
    models, _, held = tiny
    src, stats = models["llama"]
    ref = torch.log_softmax(src(held).logits, -1)

    @torch.no_grad()
    def kl(**kw):
        lp = torch.log_softmax(convert_llama(src, stats, **kw)(held), -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    assert kl(d_latent=8, rope_dims=4, layout="per-head") > kl(d_latent=40, rope_dims=4, layout="per-head")
    assert kl(d_latent=None, rope_dims=4, layout="per-head") > kl(d_latent=None, rope_dims=12, layout="per-head")


def test_kvsplice_pca_of_the_latent_is_the_smaller_conversion(tiny):
    models, calib, held = tiny
    src, stats = models["qwen2"]
    big = convert_llama(src, stats, d_latent=40, rope_dims=4, layout="shared")
    small = shrink_latent(big, 0.5, latent_gram(big, [calib]))
    assert small.cfg.d_latent == 20
    direct = convert_llama(src, stats, d_latent=20, rope_dims=4, layout="shared")

    def kv_map(m, i):  # the rank-20 map x -> [k_nope; v] of layer i
        a = m.layers[i].attn
        return torch.cat([a.w_uk.weight, a.w_uv.weight]) @ a.w_dkv.weight

    # layer 0 sees the same inputs in both: the latent's top principal directions are the rank-20 conversion's;
    # later layers see the converted model's own inputs, so they differ (a little)
    assert (kv_map(small, 0) - kv_map(direct, 0)).abs().max() <= 1e-4
    assert (kv_map(small, 2) - kv_map(direct, 2)).abs().max() > 1e-6
    with pytest.raises(ValueError, match="RMSNorm"):
        normed = convert_llama(src, stats, d_latent=40, rope_dims=4, layout="shared", latent_norm=True)
        shrink_latent(normed, 0.5, latent_gram(normed, [calib]))
    with pytest.raises(ValueError, match="at least one whole dimension"):  # 40 · 0.001: never rounded up to 1
        shrink_latent(big, 0.001, latent_gram(big, [calib]))


def test_model_folder_with_the_old_projection_names_loads(tiny, tmp_path):
    """A folder whose weights name the MLA projections kv_down / k_up / v_up reads as w_dkv / w_uk / w_uv."""
    from safetensors.torch import load_file, save_file

    from kvsplice.loading.mla_folder import WEIGHTS
    from models.compat import OLD_WEIGHT_NAMES

    models, _, held = tiny
    src, stats = models["mistral"]
    mla = convert_llama(src, stats, d_latent=20, rope_dims=4, layout="per-head")
    save_mla_folder(mla, tmp_path)
    sd = load_file(str(tmp_path / WEIGHTS))
    assert any(".attn.w_dkv." in k for k in sd) and not any(".attn.kv_down." in k for k in sd)
    old = {k: v for k, v in sd.items()}
    for o, n in OLD_WEIGHT_NAMES.items():
        old = {k.replace(n, o): v for k, v in old.items()}
    assert sum(".attn.kv_down." in k for k in old) == mla.cfg.n_layer
    save_file(old, str(tmp_path / WEIGHTS))
    assert torch.equal(load_mla_folder(tmp_path)(held), mla(held))


def test_model_folder_round_trip_and_decoder(tiny, tmp_path):
    models, _, held = tiny
    src, stats = models["mistral"]
    mla = convert_llama(src, stats, d_latent=20, rope_dims=4, layout="per-head")
    save_mla_folder(mla, tmp_path)
    again = load_mla_folder(tmp_path)
    assert again.cfg == mla.cfg and torch.equal(again(held), mla(held))
    dec = Decoder(again)
    cache = dec.new_cache(2, capacity=held.shape[1])
    assert (dec(held, cache) - mla(held)).abs().max() <= TOL
    assert measure_cache(cache).live_bytes == dec.formula_nbytes(cache) == 2 * 20 * 3 * (20 + 2 * 4) * 4
    again.cfg.cache_quant = "int8"  # int8 latents and RoPE keys: 1 byte each + an fp16 scale per row
    dec = Decoder(again)
    cache = dec.new_cache(2, capacity=held.shape[1])
    assert (dec(held, cache) - mla(held)).abs().max() < 0.1
    assert measure_cache(cache).live_bytes == dec.formula_nbytes(cache) == 2 * 20 * 3 * ((20 + 2 * 4) + 2 * 3)
    int8_err = (dec(held, dec.new_cache(2, capacity=held.shape[1])) - mla(held)).abs().max()
    again.cfg.cache_quant = "int4"  # 4-bit codes, two per byte, one group per row here + an fp16 scale and minimum
    dec = Decoder(again)
    cache = dec.new_cache(2, capacity=held.shape[1])
    assert int8_err < (dec(held, cache) - mla(held)).abs().max() < 1.0
    assert measure_cache(cache).live_bytes == dec.formula_nbytes(cache) == 2 * 20 * 3 * ((10 + 4) + 2 * (2 + 4))
    with pytest.raises(ValueError, match="converted MLA"):
        from kvsplice.adapters import model_info
        model_info(again)


@pytest.mark.parametrize("rope_dims", [8, 16])  # the 4 highest frequencies (rope_theta θ^(8/16)), or all 8
def test_deepseek_v3_export_is_our_shared_model_in_transformers(tiny, tmp_path, rope_dims):
    models, _, held = tiny
    src, stats = models["llama"]
    mla = convert_llama(src, stats, d_latent=20, rope_dims=rope_dims, layout="shared", latent_norm=True)
    save_deepseek_v3(mla, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["q_lora_rank"] is None and cfg["kv_lora_rank"] == 20
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] and "auto_map" not in cfg
    ds = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(ds).__name__ == "DeepseekV3ForCausalLM"
    assert (ds(held).logits - mla(held)).abs().max() <= TOL
    cache = transformers.DynamicCache(config=ds.config)
    ds(held, past_key_values=cache, use_cache=True)
    # transformers 5.23 caches the normed latent and the rotated shared RoPE key (1 "head" each), not K/V
    assert sum(t.numel() for l in cache.layers for t in (l.keys, l.values)) == 2 * 20 * 3 * (20 + rope_dims)
    per_head = convert_llama(src, stats, d_latent=20, rope_dims=8, layout="per-head", latent_norm=True)
    with pytest.raises(ValueError, match="per-head layout"):
        check_exportable(per_head)



@pytest.mark.parametrize("edit,expect", [({"kv_lora_rank": 16}, "wrongly shaped weights"),
                                         ({"num_hidden_layers": 2}, "numbered layers")])
def test_a_deepseek_v3_folder_with_an_edited_config_is_one_line(tiny, tmp_path, edit, expect):
    """A hand-edited DeepSeek-V3 ``config.json`` fed back was refused after transformers' multi-line load report:
    the refusal is the only line (a process of its own: pytest's log capture would hide the report)."""
    import os
    import subprocess
    import sys

    from hostile import REPO

    models, _, _ = tiny
    src, stats = models["llama"]
    save_deepseek_v3(convert_llama(src, stats, d_latent=20, rope_dims=8, layout="shared", latent_norm=True),
                     tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    r = subprocess.run([sys.executable, "-m", "kvsplice.cli.generate", "--model", str(tmp_path), "--prompt", "hi",
                        "--max-new-tokens", "1"], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    one_error(r.returncode, r.stderr, "generate", expect)

# ------------------------------------------------------------------------------------------------ the CLI
def run(args, capsys):
    capsys.readouterr()
    rc = to_mla.main([str(a) for a in args])
    return (rc, *capsys.readouterr())


@pytest.fixture(scope="module")
def s260k(tmp_path_factory):
    if not ((STORIES / "stories260K.bin").is_file() and CALIB.is_file()):
        pytest.skip(f"stories260K / TinyStories not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))


def test_cli_full_rank_stories260k_is_exact_and_loads_everywhere(s260k, tmp_path, capsys):
    out = tmp_path / "mla"
    rc, so, se = run(["--model", s260k, "--calib", CALIB, "--calib-tokens", 4096, "--seq-len", 256, "--d-latent",
                      "full", "--rope-dims", "all", "--out", out, "--no-progress"], capsys)
    assert rc == 0, se
    src, mla = load_model(s260k), load_model(out)
    assert mla.kind == "mla" and mla.tokenizer.vocab_size == src.tokenizer.vocab_size
    ids = torch.tensor([src.tokenizer.document("Once upon a time there was a little dog named Max.")])
    assert (mla.model(ids) - src.model(ids).logits).abs().max() <= TOL
    from kvsplice.cli import generate

    capsys.readouterr()
    assert generate.main(["--model", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "5"]) == 0
    assert "bytes measured" in "".join(capsys.readouterr())
    from kvsplice.cli import eval_bases

    assert eval_bases.main(["--model", str(out), "--data", str(CALIB), "--tokens", "512", "--seq-len", "128",
                            "--prompt-len", "96", "--no-progress"]) == 0
    assert "1.00x smaller" in capsys.readouterr().out  # the full-rank latent + RoPE keys = the K/V numbers
    assert eval_bases.main(["--model", str(out), "--data", str(CALIB), "--bases", str(out / "x.safetensors")]) == 2
    from kvsplice.cli import eval_tasks  # the task suite on its own cache: the same answers as the source (exact here)

    texts = []
    for model in (out, s260k):
        task = ["--model", str(model), "--method", "full", "--tasks", "passkey", "--lengths", "160", "--n", "2",
                "--setting", "agnostic", "--no-progress", "--out", str(tmp_path / f"t{len(texts)}.json")]
        assert eval_tasks.main(task) == 0
        doc = json.loads((tmp_path / f"t{len(texts)}.json").read_text())
        texts.append([r["full"]["tokens"] for r in doc["results"]["agnostic"].values()])
    assert texts[0] == texts[1] and len(texts[0]) == 2
    capsys.readouterr()
    assert eval_tasks.main(["--model", str(out), "--method", "int8"] + task[4:-1] + [str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "its own cache" in err and len(err.strip().splitlines()) == 1
    rc, so, se = run(["--model", s260k, "--calib", CALIB, "--d-latent", "full", "--out", out, "--no-progress"], capsys)
    assert rc == 2 and "not empty" in se and len(se.strip().splitlines()) == 1  # nothing overwritten


def test_cli_shared_deepseek_export_and_kvsplice(s260k, tmp_path, capsys):
    common = ["--model", s260k, "--calib", CALIB, "--calib-tokens", 4096, "--seq-len", 256, "--no-progress"]
    ds = tmp_path / "ds"
    rc, so, se = run(common + ["--d-latent", 24, "--rope-layout", "shared", "--format", "deepseek_v3",
                               "--out", ds], capsys)
    assert rc == 0, se
    model = transformers.AutoModelForCausalLM.from_pretrained(ds)
    assert model.config.kv_lora_rank == 24 and model.config.qk_rope_head_dim == 8  # shared default: every freq.
    native = tmp_path / "native"
    assert run(common + ["--d-latent", 24, "--rope-layout", "shared", "--out", native], capsys)[0] == 0
    padded = tmp_path / "padded"  # the converted folder re-exported with the latent / RoPE key padded, exactly
    rc, so, se = run(["--model", native, "--format", "deepseek_v3", "--pad-latent", 40, "--pad-rope", 16,
                      "--out", padded, "--no-progress"], capsys)
    assert rc == 0, se
    wide = transformers.AutoModelForCausalLM.from_pretrained(padded)
    assert (wide.config.kv_lora_rank, wide.config.qk_rope_head_dim) == (40, 16)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (wide(ids).logits - model(ids).logits).abs().max() <= 1e-4
    small = tmp_path / "small"
    rc, so, se = run(["--model", native, "--calib", CALIB, "--calib-tokens", 4096, "--seq-len", 256,
                      "--kvsplice-ratio", 0.5, "--out", small, "--no-progress"], capsys)
    assert rc == 0, se
    assert load_model(small).model.cfg.d_latent == 12


def test_cli_never_writes_inside_the_input_folder(s260k, tmp_path, capsys):
    """``to_mla --out MODEL/sub --force`` wrote into the input's folder; an input inside ``--out`` is
    refused too. Refused before any work: the model folder is left as it was."""
    model = tmp_path / "model"
    shutil.copytree(s260k, model)
    before = snapshot(tmp_path)
    for out in (model / "sub", model / "sub" / "deeper", tmp_path):
        rc, so, se = run(["--model", model, "--calib", CALIB, "--d-latent", 24, "--out", out, "--force",
                          "--no-progress"], capsys)
        one_error(rc, se, "to_mla", "input")
        assert snapshot(tmp_path) == before, out


@pytest.mark.parametrize("extra,msg", [
    (["--format", "deepseek_v3"], "--rope-layout shared"),
    (["--format", "deepseek_v3", "--rope-layout", "shared", "--latent-norm"], "unusable"),
    (["--pad-rope", "64"], "pad the cache row of a --format deepseek_v3"),
    (["--rope-dims", "3"], "must be even"),
    (["--d-latent", "9999"], "must be in"),
    (["--no-calib"], "needs --calib"),
])
def test_cli_bad_input_is_one_line_exit_2(s260k, tmp_path, capsys, extra, msg):
    args = ["--model", s260k, "--out", tmp_path / "o", "--no-progress", "--calib-tokens", 2048, "--seq-len", 128]
    args += [] if extra == ["--no-calib"] else ["--calib", CALIB] + extra
    rc, so, se = run(args, capsys)
    assert rc == 2 and msg in se and len(se.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_smollm2_full_rank_per_head_is_exact(tmp_path):
    if not SMOL.is_file() or not CALIB.is_file():
        pytest.skip("SmolLM2 GGUF / TinyStories not found")
    loaded = load_model(SMOL)
    from kvsplice.loading import iter_texts, token_stream

    ids, _ = token_stream(iter_texts(CALIB), loaded.tokenizer, 1024)
    stats = calibrate_layers(loaded.model, [ids[:512].view(2, 256)])
    a = loaded.model.config
    mla = convert_llama(loaded.model, stats, d_latent=None, rope_dims=a.head_dim, layout="per-head")
    assert mla.cfg.d_latent == full_latent(a.num_key_value_heads, a.head_dim, a.head_dim, "per-head", a.hidden_size)
    held = ids[512:].view(2, 256)
    assert (mla(held) - loaded.model(held).logits).abs().max() <= TOL
