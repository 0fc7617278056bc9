"""The post-training CLIs end to end: ``kvsplice fit-bases`` and ``kvsplice eval-bases`` on the
real pretrained stories260K (GQA + RoPE, converted with kvsplice.convert_llama2c) with real TinyStories text, a tiny
random HF GPT-2 and Llama, and a kvsplice training checkpoint. Skips cleanly without ../shared/data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvsplice.cli import eval_bases, fit_bases  # noqa: E402
from kvsplice.lowrank.bases import KVBases  # noqa: E402
from kvsplice.adapters import model_fingerprint  # noqa: E402
from tiny_models import save_model_dirs  # noqa: E402
from hostile import prog_of

REPO = Path(__file__).resolve().parents[3]
DATA = REPO.parent / "shared" / "data"
STORIES = DATA / "stories260K"
CALIB = DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"
EVAL = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
GPT2_TOK = DATA / "gpt2_tokenizer"

pytestmark = pytest.mark.skipif(
    not all(p.is_file() for p in (STORIES / "stories260K.bin", STORIES / "tok512.bin", CALIB, EVAL)),
    reason=f"stories260K / TinyStories reference data not found under {DATA}")

FIT_SMALL = ["--calib", str(CALIB), "--calib-tokens", "4096", "--seq-len", "256", "--no-progress"]
EVAL_SMALL = ["--data", str(EVAL), "--tokens", "2048", "--seq-len", "256", "--no-progress"]




def run(cli, args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before (e.g. save_pretrained progress bars)
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(err: str, prog: str) -> str:
    """The CLI printed exactly one error line (``PROG: error: ...``, no traceback); return it."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog_of(prog)}: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------------------------ models
@pytest.fixture(scope="module")
def s260k(tmp_path_factory) -> Path:
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))


@pytest.fixture(scope="module")
def tiny_dirs(s260k, tmp_path_factory) -> dict[str, Path]:
    """A tiny random GQA Llama and a tiny random GPT-2, saved with save_pretrained plus a tokenizer (stories260K's
    512-token one: small and fast to load)."""
    tok = transformers.AutoTokenizer.from_pretrained(s260k)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=512, n_positions=256, n_embd=32,
                                                                n_layer=2, n_head=4))
    return save_model_dirs({"llama": llama, "gpt2": gpt2}, tok, tmp_path_factory)


# ------------------------------------------------------------------------------------------------ fit
def test_fit_writes_bases_with_metadata(s260k, tmp_path, capsys):
    out = tmp_path / "b.safetensors"
    rc, stdout, err = run(fit_bases, ["--model", s260k, "--method", "gqa-sum", "--energy", 0.9, *FIT_SMALL,
                                      "--out", out, "--json", tmp_path / "fit.json"], capsys)
    assert rc == 0, err
    b = KVBases.load(out)
    assert (b.method, b.rope, b.n_layer, b.n_kv_head) == ("gqa-sum", "post", 5, 4)
    m = b.meta
    model = transformers.AutoModelForCausalLM.from_pretrained(s260k)
    assert m["model_fingerprint"] == model_fingerprint(model)
    assert m["calibration_tokens"] == 4096 and m["calibration_source"] == str(CALIB)
    assert m["method"] == "gqa-sum" and m["energy"] == 0.9 and m["seq_len"] == 256
    # energy-chosen ranks differ per head; each retains >= 90 % of its spectrum
    assert all(e >= 0.9 - 1e-6 for row in m["retained_k"] + m["retained_v"] for e in row)
    rep = json.loads((tmp_path / "fit.json").read_text())
    assert rep["ranks_k"] == b.ranks()["k"] and rep["ranks_v"] == b.ranks()["v"]
    assert rep["timings_s"]["plain_forward"] > 0 and rep["timings_s"]["calibrate_plus_fit_over_forward"] > 0
    assert rep["calibration"]["tokens"] == 4096 and rep["calibration"]["stats_nbytes"] > 0
    for s in ("retained K", "calibration", "plain forward", "(calibration + fit) / forward", "saved"):
        assert s in stdout


def test_refuses_to_overwrite(s260k, tmp_path, capsys):
    out = tmp_path / "b.safetensors"
    out.write_bytes(b"precious")
    args = ["--model", s260k, "--method", "ksvd", "--rank", 2, *FIT_SMALL, "--out", out]
    rc, _, err = run(fit_bases, args, capsys)
    line = one_error(err, "fit_bases")
    assert rc == 2 and "already exists" in line and "--force" in line
    assert out.read_bytes() == b"precious"
    bad = [a if a != str(CALIB) else str(tmp_path / "missing.txt") for a in FIT_SMALL]
    rc, _, err = run(fit_bases, args[:6] + bad + ["--out", out, "--force"], capsys)  # a failing --force run
    assert rc == 2 and "not found" in one_error(err, "fit_bases")
    assert out.read_bytes() == b"precious"  # nothing is written before the fit succeeded
    rc, _, err = run(fit_bases, args + ["--force"], capsys)
    assert rc == 0, err
    assert KVBases.load(out).ranks()["k"] == [[2] * 4] * 5


def test_fit_errors_are_one_line(s260k, tmp_path, capsys, monkeypatch):
    out = tmp_path / "b.safetensors"
    cases = [
        (["--model", s260k, "--method", "kq", "--rank", 2, "--calib", tmp_path / "nope.txt", "--out", out],
         "not found"),
        (["--model", tmp_path / "no_model", "--method", "kq", "--rank", 2, *FIT_SMALL, "--out", out], "not found"),
        (["--model", tmp_path, "--method", "kq", "--rank", 2, *FIT_SMALL, "--out", out], "config.json"),
        (["--model", s260k, "--method", "kq", "--rank", 9, *FIT_SMALL, "--out", out], "head_dim 8"),
        (["--model", s260k, "--method", "kq", "--rank", 2, "--uniform-ranks", *FIT_SMALL, "--out", out],
         "--uniform-ranks raises the ranks --energy chooses"),  # an option that would do nothing
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases.append((["--model", "someone/some-model-xyz", "--method", "kq", "--rank", 2, *FIT_SMALL, "--out", out],
                  "kvsplice convert-llama2c"))
    for args, needle in cases:
        rc, _, err = run(fit_bases, args, capsys)
        assert rc == 2 and needle in one_error(err, "fit_bases"), (args, err)
        assert not out.exists()


def test_unsupported_model_family(s260k, tmp_path_factory, capsys):
    d = tmp_path_factory.mktemp("opt")
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(vocab_size=512, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                 num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16)
    transformers.OPTForCausalLM(cfg).save_pretrained(d)
    rc, _, err = run(fit_bases, ["--model", d, "--method", "kq", "--rank", 2, *FIT_SMALL, "--out",
                                 d / "b.safetensors"], capsys)
    assert rc == 2 and "unsupported model" in one_error(err, "fit_bases")


# ------------------------------------------------------------------------------------------------ eval
@pytest.fixture(scope="module")
def s260k_bases(s260k, tmp_path_factory):
    d = tmp_path_factory.mktemp("bases")
    out = {}
    for name, args in (("full_pre", ["--method", "gqa-concat", "--rank", 8, "--rope", "pre"]),
                       ("full_post", ["--method", "kq", "--rank", 8]),
                       ("low_post", ["--method", "ksvd", "--rank", 2]),
                       ("low_pre", ["--method", "gqa-sum", "--energy", 0.8, "--rank-v", 4, "--rope", "pre"])):
        out[name] = d / f"{name}.safetensors"
        assert fit_bases.main([str(a) for a in ["--model", s260k, *args, *FIT_SMALL, "--out", out[name],
                                                "--no-forward-timing"]]) == 0
    return out


def test_eval_full_rank_matches_low_rank_worse(s260k, s260k_bases, tmp_path, capsys):
    rep_path = tmp_path / "eval.json"
    files = [s260k_bases[k] for k in ("full_pre", "full_post", "low_post", "low_pre")]
    rc, stdout, err = run(eval_bases, ["--model", s260k, "--bases", *files, *EVAL_SMALL, "--json", rep_path, "--diagnostics"],
                          capsys)
    assert rc == 0, err
    rep = json.loads(rep_path.read_text())
    full = rep["full"]
    assert abs(full["ppl"] / full["model_forward_ppl"] - 1) < 1e-4  # the driver's full cache is the model
    assert full["cache"]["bytes_match"] and full["cache"]["measured_live_bytes"] == 2 * 5 * 4 * 8 * 256 * 8 * 4
    res = {Path(r["bases_file"]).stem: r for r in rep["results"]}
    assert res["full_pre"]["rope"] == "pre" and res["full_post"]["rope"] == "post"
    for k in ("full_pre", "full_post"):
        assert abs(res[k]["ppl"] / full["ppl"] - 1) < 1e-4, (k, res[k]["ppl"], full["ppl"])
        assert all(row["scores"] < 1e-3 and row["attn_out"] < 1e-3 for row in res[k]["layers"])
    for k in ("low_post", "low_pre"):
        assert res[k]["ppl"] > full["ppl"] * 1.01
    assert res["low_pre"]["ranks_v"] == [[4] * 4] * 5
    for r in res.values():
        c = r["cache"]
        assert c["bytes_match"]
        assert c["measured_live_bytes"] == c["formula_bytes"] == r["elements_per_token"] * 256 * 8 * 4
        assert c["full_kv_formula_bytes"] == full["cache"]["measured_live_bytes"]
        for row in r["layers"]:
            for key in ("scores", "scores_sum", "keys", "values", "values_plain"):
                assert 0.0 <= row[key] <= 1.0, (key, row[key])
            assert row["attn_out"] >= 0 and row["lesens"]["gap_rel"] >= 0
            assert row["lesens"]["kq_opt_err"] <= row["lesens"]["konly_opt_err"] + 1e-6  # rounding at full rank
    for s in ("full K/V", "ppl / full", "score err", "Lesens"):
        assert s in stdout


def test_chunked_decode_equals_token_by_token(s260k, s260k_bases):
    from kvsplice.decode import Decoder
    from kvsplice.lowrank.method import LowRank
    from kvsplice.loading import load_model

    loaded = load_model(s260k)
    windows, _ = eval_bases.load_windows(loaded, str(EVAL), 128, 64)
    ctx = eval_bases.EvalContext(loaded, windows, batch_size=2, chunk_size=64)
    dec = Decoder(loaded.model, LowRank(KVBases.load(s260k_bases["low_pre"])))
    a = ctx.decode(dec)["ppl"]
    ctx.chunk_size = 1
    assert abs(ctx.decode(dec)["ppl"] / a - 1) < 1e-5


def test_bases_from_another_model(s260k, tiny_dirs, tmp_path, capsys):
    other = tmp_path / "llama.safetensors"
    assert fit_bases.main([str(a) for a in ["--model", tiny_dirs["llama"], "--method", "gqa-concat", "--rank", 4,
                                            *FIT_SMALL, "--out", other]]) == 0
    rc, _, err = run(eval_bases, ["--model", s260k, "--bases", other, *EVAL_SMALL], capsys)
    assert rc == 2 and "fitted for model" in one_error(err, "eval_bases")


def test_eval_missing_data(s260k, s260k_bases, tmp_path, capsys):
    rc, _, err = run(eval_bases, ["--model", s260k, "--bases", s260k_bases["low_post"], "--data",
                                  tmp_path / "missing.txt", "--no-progress"], capsys)
    assert rc == 2 and "not found" in one_error(err, "eval_bases")


def test_gpt2_full_rank_and_rope_none(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "g.safetensors"
    rc, _, err = run(fit_bases, ["--model", tiny_dirs["gpt2"], "--method", "eigen", "--rank", 8, "--rope", "pre",
                                 *FIT_SMALL, "--out", out], capsys)
    assert rc == 0, err
    assert KVBases.load(out).rope == "none"  # no RoPE in GPT-2: --rope does not apply
    rc, _, err = run(eval_bases, ["--model", tiny_dirs["gpt2"], "--bases", out, *EVAL_SMALL,
                                  "--json", tmp_path / "e.json"], capsys)
    assert rc == 0, err
    r = json.loads((tmp_path / "e.json").read_text())["results"][0]
    assert abs(r["ppl_ratio"] - 1) < 1e-4 and r["cache"]["bytes_match"]


def test_training_checkpoint(tmp_path, capsys):
    ckpt_mod = pytest.importorskip("training.checkpoint")
    if not (GPT2_TOK / "encoder.json").is_file():
        pytest.skip("GPT-2 tokenizer files not found")
    from models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50257, n_layer=2, n_head=2, d_model=32, block_size=128, attention="mha")
    model = GPT(cfg)
    path = tmp_path / "last.ckpt"
    torch.save({ckpt_mod.CKPT_FORMAT_KEY: ckpt_mod.CKPT_FORMAT, "gpt_config": cfg.to_dict(),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "datamodule_hyper_parameters": {"tokenizer_path": str(GPT2_TOK), "block_size": 128}}, path)
    out = tmp_path / "c.safetensors"
    rc, _, err = run(fit_bases, ["--model", path, "--method", "kq", "--rank", 16, "--calib", CALIB, "--calib-tokens",
                                 1024, "--no-progress", "--out", out], capsys)
    assert rc == 0, err
    b = KVBases.load(out)
    assert b.meta["seq_len"] == 128 and b.meta["tokenizer"]["separator"] == "eos"
    assert b.meta["tokenizer"]["eos_id"] == 50256
    rc, _, err = run(eval_bases, ["--model", path, "--bases", out, "--data", EVAL, "--tokens", 512,
                                  "--no-progress", "--json", tmp_path / "e.json"], capsys)
    assert rc == 0, err
    r = json.loads((tmp_path / "e.json").read_text())["results"][0]
    assert abs(r["ppl_ratio"] - 1) < 1e-4


def test_cli_process_exit_codes(tmp_path):
    """The real entry points: a missing bases file fails before any model is loaded, with status 2."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "kvsplice.cli.eval_bases", "--model", str(tmp_path), "--bases",
                        str(tmp_path / "missing.safetensors"), "--data", str(EVAL)], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == \
        f"kvsplice eval-bases: error: bases file not found: {tmp_path / 'missing.safetensors'}"


def test_eval_cache_quant_int8(s260k, s260k_bases, tmp_path, capsys):
    """--cache-quant int8: every bases file decoded again with int8 rows + fp16 scales, plus the full K/V cache
    quantised; measured bytes == formula; perplexity within 1 % of the unquantised cache on real text."""
    out = tmp_path / "q.json"
    rc, _, err = run(eval_bases, ["--model", s260k, "--bases", s260k_bases["low_post"], s260k_bases["low_pre"],
                                  *EVAL_SMALL, "--cache-quant", "int8", "--json", out], capsys)
    assert rc == 0, err
    res = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    assert set(res) == {"low_post", "low_post+int8", "low_pre", "low_pre+int8", "full K/V+int8"}
    for name in ("low_post", "low_pre"):
        q, plain = res[f"{name}+int8"], res[name]
        assert q["cache"]["bytes_match"] and q["cache"]["kind"] == "CoefficientCache"
        rows = 2 * 5 * 4  # key + value rows per token: 5 layers × 4 KV heads
        assert q["cache"]["measured_live_bytes"] == (plain["elements_per_token"] + 2 * rows) * 256 * 8
        assert 0 < abs(q["ppl_change_from_quant"]) < 0.01
    full = res["full K/V+int8"]
    assert full["cache"]["bytes_match"] and full["cache"]["measured_live_bytes"] == 2 * 5 * 4 * (8 + 2) * 256 * 8
    assert abs(full["ppl_ratio"] - 1) < 0.01
