"""MHA → MLA conversion, KVSplice PCA init, ``kvsplice to-mla`` and fine-tuning with
``--model.init_from``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hostile import dead_pid, edit_ckpt, one_error, readonly_dir, snapshot, tiny_ckpt  # noqa: F401
from kvsplice.convert.mla import (attention_input_grams, insert_kvsplice, kv_relative_error, kv_rows, latent_grams,
                                  mha_to_mla)
from kvsplice.cli.to_mla import main as to_mla
from models.checkpoint import load_gpt_checkpoint, save_model
from models.config import GPTConfig
from models.gpt import GPT
from tiny_models import TINY_FIT_ARGS as TINY, sharpen


def _mha(n_kv_head=None, seed=0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=67, n_layer=2, n_head=4, d_model=32, block_size=48, n_kv_head=n_kv_head)
    return sharpen(GPT(cfg), std=0.15, seed=seed)


def _ids(seed: int, b: int = 4, t: int = 40) -> torch.Tensor:
    return torch.randint(0, 67, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
def test_full_rank_conversion_reproduces_the_model(n_kv_head) -> None:
    """R = d_model: weights-only and activation-aware conversions give the MHA/GQA/MQA model's logits (1e-4)."""
    mha = _mha(n_kv_head)
    ids = _ids(1)
    ref = mha(ids)
    grams = attention_input_grams(mha, [_ids(2)])[0]
    for g in (None, grams):
        mla = mha_to_mla(mha, 32, g)
        assert mla.cfg.attention == "mla" and mla.cfg.d_latent == 32 and mla.cfg.n_kv_head is None
        assert (mla(ids) - ref).abs().max() < 1e-4
        cache = mla.new_cache(4)  # and its cached (absorbed) decode is the same model
        out = torch.cat([mla(ids[:, :30], cache=cache)] + [mla(ids[:, i:i + 1], cache=cache) for i in range(30, 40)], 1)
        assert (out - ref).abs().max() < 1e-4


def test_activation_aware_beats_weights_only_on_the_calibration_inputs() -> None:
    mha = _mha()
    grams = attention_input_grams(mha, [_ids(3, 8)])[0]
    for r in (4, 8, 16):
        w_only = kv_relative_error(mha, mha_to_mla(mha, r), grams)
        aware = kv_relative_error(mha, mha_to_mla(mha, r, grams), grams)
        assert all(a <= w + 1e-12 for a, w in zip(aware, w_only)), (r, aware, w_only)
        assert sum(aware) < sum(w_only)
    # the weights-only error is the SVD tail: sum of the discarded squared singular values (for an identity Gram)
    eye = [torch.eye(32, dtype=torch.float64)] * 2
    _, wk, wv, *_ = kv_rows(mha, 0)
    s = torch.linalg.svdvals(torch.cat([wk, wv]))
    want = float((s[8:] ** 2).sum() / (s ** 2).sum())
    assert abs(kv_relative_error(mha, mha_to_mla(mha, 8), eye)[0] - want) < 1e-9


def test_biases_carried_and_shared_weights_copied() -> None:
    mha = _mha()
    mla = mha_to_mla(mha, 8)
    a, m = mha.transformer.h[1].attn, mla.transformer.h[1].attn
    assert torch.equal(m.w_q.weight, a.c_attn.weight[:32]) and torch.equal(m.w_uk.bias, a.c_attn.bias[32:64])
    assert torch.equal(m.w_uv.bias, a.c_attn.bias[64:]) and not m.w_dkv.bias.any()
    assert torch.equal(mla.transformer.h[1].mlp.c_fc.weight, mha.transformer.h[1].mlp.c_fc.weight)
    assert torch.equal(mla.transformer.wte.weight, mha.transformer.wte.weight)


def test_kvsplice_pca_init_is_the_best_projection_of_the_latents() -> None:
    mla = mha_to_mla(_mha(), 16)
    ids = _ids(4, 8)
    grams = latent_grams(mla, [ids])[0]
    pca = insert_kvsplice(mla, 0.5, grams)
    rand = insert_kvsplice(mla, 0.5, seed=3)
    assert pca.cfg.d_compressed == 8 and pca.cfg.variant == "mla_kvsplice_50"
    for g, bp, br in zip(grams, pca.transformer.h, rand.transformer.h):
        for block in (bp, br):
            c, e = block.attn.splice.compress.weight.double(), block.attn.splice.expand.weight.double()
            assert torch.allclose(c @ c.T, torch.eye(8, dtype=torch.float64), atol=1e-5)  # orthonormal rows
            assert torch.allclose(e, c.T)
        def residual(block) -> float:  # Σ ‖c − E C c‖² over the calibration latents
            c = block.attn.splice.compress.weight.double()
            p = torch.eye(16, dtype=torch.float64) - c.T @ c
            return float(torch.trace(p @ g @ p))
        assert residual(bp) <= residual(br) + 1e-9
        evals = torch.linalg.eigvalsh(g)
        assert abs(residual(bp) - float(evals[:8].sum())) < 1e-6 * float(evals.sum())  # Eckart-Young optimum
    ref = mla(ids)
    assert (pca(ids) - ref).abs().mean() < (rand(ids) - ref).abs().mean()
    full = insert_kvsplice(mla, 0.999, grams)  # round(16 · 0.999) = 16: a full-rank splice is exact
    assert (full(ids) - ref).abs().max() < 1e-4


def test_insert_kvsplice_refuses_non_mla() -> None:
    with pytest.raises(ValueError, match="needs an MLA model"):
        insert_kvsplice(_mha(), 0.5)
    with pytest.raises(ValueError, match="needs an MHA/GQA model"):
        mha_to_mla(mha_to_mla(_mha(), 8), 4)
    with pytest.raises(ValueError, match="d_latent must be in"):
        mha_to_mla(_mha(), 33)


def test_kvsplice_ratio_keeps_at_least_one_whole_dimension() -> None:
    """A ratio that asks for less than one dimension of the latent is refused (never rounded up to one); 1/R keeps
    exactly one, and the converted model runs."""
    mla = mha_to_mla(_mha(), 16)
    with pytest.raises(ValueError, match=r"asks for 0.8 dimensions.*kept fraction >= 1/16"):
        insert_kvsplice(mla, 0.05)
    one = insert_kvsplice(mla, 1 / 16, latent_grams(mla, [_ids(4)])[0])
    assert one.cfg.d_compressed == 1 and torch.isfinite(one(_ids(1))).all()


# ------------------------------------------------------------------------------------------------ CLI + fine-tune
@pytest.fixture(scope="module")
def mha_ckpt(tmp_path_factory, data_cache: Path) -> Path:
    """A short real training run of a tiny MHA model (synthetic data), its last checkpoint."""
    from training.fit import main as fit

    runs = tmp_path_factory.mktemp("to_mla") / "runs"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("WANDB_MODE", "disabled")
        assert fit(["--config", "tiny_gpt2", *TINY, "--runs_dir", str(runs), "--run_name", "mha", "--data.cache_dir",
                    str(data_cache), "--wandb.mode", "disabled", "--trainer.max_steps", "30",
                    "--trainer.val_check_interval", "30", "--model.warmup_steps", "3"]) == 0
    return runs / "mha" / "last.ckpt"


def test_cli_convert_and_finetune(tmp_path: Path, mha_ckpt: Path, data_cache: Path, offline, capsys) -> None:
    from training.fit import main as fit

    calib = tmp_path / "calib.txt"
    calib.write_text("\n<|endoftext|>\n".join(f"Once upon a time Lily saw {i} red balls and ran home." for i in
                                               range(300)), encoding="utf-8")
    out = tmp_path / "mla.ckpt"
    assert to_mla(["--model", str(mha_ckpt), "--d-latent", "16", "--calib", str(calib), "--calib-tokens", "2048",
                   "--kvsplice-ratio", "0.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "activation-aware" in printed and "KVSplice init pca" in printed and "relative K/V error" in printed
    model, cfg, meta = load_gpt_checkpoint(out)
    assert cfg.variant == "mla_kvsplice_50" and cfg.d_latent == 16 and cfg.cache_dim == 8
    assert meta["data_hparams"]["synthetic"] is True  # the source's data settings travel with the checkpoint
    # an existing --out is never overwritten without --force
    before = out.stat().st_mtime_ns
    assert to_mla(["--model", str(mha_ckpt), "--d-latent", "16", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.stat().st_mtime_ns == before
    # full rank through the CLI (weights only): the same logits as the source
    exact = tmp_path / "exact.ckpt"
    assert to_mla(["--model", str(mha_ckpt), "--d-latent", "64", "--out", str(exact)]) == 0
    src = load_gpt_checkpoint(mha_ckpt)[0]
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (load_gpt_checkpoint(exact)[0](ids) - src(ids)).abs().max() < 1e-4
    # two steps: MHA -> MLA, then KVSplice into that MLA checkpoint (an MLA model as --model)
    mla_only = tmp_path / "mla_only.ckpt"
    assert to_mla(["--model", str(mha_ckpt), "--d-latent", "16", "--out", str(mla_only)]) == 0
    spliced = tmp_path / "spliced.ckpt"
    assert to_mla(["--model", str(mla_only), "--kvsplice-ratio", "0.5", "--calib", str(calib), "--calib-tokens",
                   "2048", "--out", str(spliced)]) == 0
    assert load_gpt_checkpoint(spliced)[1].variant == "mla_kvsplice_50"
    assert to_mla(["--model", str(mla_only), "--out", str(tmp_path / "x.ckpt")]) == 2
    assert "give --kvsplice-keep" in capsys.readouterr().err
    # fine-tune from the converted weights: a fresh run (step 0, new optimizer) that trains
    runs = tmp_path / "ft"
    args = ["--config", "tiny_mla_kvsplice_50", *TINY, "--model.d_latent", "16", "--runs_dir", str(runs),
            "--run_name", "ft", "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled",
            "--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--model.warmup_steps", "2",
            "--model.init_from", str(out)]
    assert fit(args) == 0
    tuned, _, tmeta = load_gpt_checkpoint(runs / "ft" / "last.ckpt")
    assert tmeta["global_step"] == 6
    start = model.state_dict()
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, start[k])]
    assert changed and "transformer.h.0.attn.splice.compress.weight" in changed
    # a mismatched architecture is one clear error naming the fields
    bad = [a if a != "tiny_mla_kvsplice_50" else "tiny_mla" for a in args]
    assert fit([*bad, "--run_name", "bad"]) == 2
    err = capsys.readouterr().err
    assert "model.init_from" in err and "kvsplice_keep" in err and "--model.kvsplice_keep 0.5" in err


@pytest.mark.parametrize("args, msg", [
    ([], "give --d-latent R"),
    (["--d-latent", "8", "--kvsplice-ratio", "0.5"], "--kvsplice-init pca needs --calib"),
    (["--d-latent", "999"], "larger than d_model"),
    (["--d-latent", "8", "--kvsplice-ratio", "0.001", "--kvsplice-init", "random"],
     "--kvsplice-ratio 0.001 of the 8-dim latent asks for 0.008 dimensions"),
    (["--d-latent", "8", "--kvsplice-keep", "0.5"], "--kvsplice-init pca needs --calib"),
    (["--d-latent", "8", "--kvsplice-keep", "0.001", "--kvsplice-init", "random"],
     "--kvsplice-keep 0.001 of the 8-dim latent asks for 0.008 dimensions"),
])
def test_cli_errors(tmp_path: Path, mha_ckpt: Path, capsys, args, msg) -> None:
    """One error line; the old spelling --kvsplice-ratio (the kept fraction) adds one note naming --kvsplice-keep."""
    out = tmp_path / "o.ckpt"
    assert to_mla(["--model", str(mha_ckpt), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert msg in err and len(err.splitlines()) - len(notes) == 1 and not out.exists()
    assert notes == (["note: --kvsplice-ratio is the kept fraction of the latent, now spelled --kvsplice-keep"]
                     if "--kvsplice-ratio" in args else [])


def test_cli_threads_beyond_the_cpus_are_refused_first(tmp_path: Path, capsys) -> None:
    """``--threads 100000`` was handed to torch; the model's libraries then failed to load ("cannot load the model")."""
    threads = torch.get_num_threads()
    try:
        rc = to_mla(["--model", str(tmp_path / "nope"), "--d-latent", "8", "--threads", "100000", "--out",
                     str(tmp_path / "o")])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvsplice to-mla: error: --threads must be <=") and "\n" not in err, err


def test_save_model_roundtrip(tmp_path: Path) -> None:
    mla = mha_to_mla(_mha(), 8)
    p = save_model(mla, tmp_path / "m.ckpt", hparams={"learning_rate": 1e-3}, extra={"note": "x"})
    model, cfg, meta = load_gpt_checkpoint(p)
    assert cfg == mla.cfg and meta["hparams"]["learning_rate"] == 1e-3 and meta["hparams"]["d_latent"] == 8
    ids = _ids(5)
    assert torch.equal(model(ids), mla(ids))


# ------------------------------------------------------------------------------ inputs and outputs
# Hostile inputs to ``kvsplice to-mla``: ``--out`` never replaces an input (the same path, a
# symlink, a hard link, another spelling; ``--json`` too), errors exit 2 in one line (a read-only destination
# included), source checkpoints with NaN / integer weights are refused naming the tensor, and the temporary file a
# killed run left beside ``--out`` is removed by the next run.

W = "model.transformer.h.1.attn.c_attn.weight"


@pytest.fixture(scope="module")
def src(tmp_path_factory, data_cache) -> Path:
    return tiny_ckpt(tmp_path_factory.mktemp("src") / "X.ckpt", data_cache)


def convert(argv, capsys):
    capsys.readouterr()
    rc = to_mla([str(a) for a in argv])
    return rc, capsys.readouterr().err


def test_out_is_never_an_input(src, tmp_path, capsys, monkeypatch):
    calib = tmp_path / "calib.txt"
    calib.write_text("Once upon a time there was a cat.\n\nThe cat was happy.\n")
    (tmp_path / "link.ckpt").symlink_to(src)
    os.link(src, tmp_path / "hard.ckpt")
    monkeypatch.chdir(src.parent)
    before = snapshot(src.parent) | snapshot(tmp_path)
    base = ["--model", src, "--d-latent", "8"]
    cases = {  # item 4: the source checkpoint replaced by its own conversion
        "the same path": ["--out", src, "--force"],
        "a relative spelling": ["--out", Path("sub/../X.ckpt"), "--force"],
        "a symlink to it": ["--out", tmp_path / "link.ckpt", "--force"],
        "a hard link to it": ["--out", tmp_path / "hard.ckpt", "--force"],
        "--json": ["--out", tmp_path / "new.ckpt", "--json", src, "--force"],
        "the calibration text": ["--out", calib, "--calib", calib, "--force"],
    }
    for name, extra in cases.items():
        rc, err = convert(base + extra, capsys)
        one_error(rc, err, "to_mla", "writing it would replace the input")
        assert snapshot(src.parent) | snapshot(tmp_path) == before, name
    rc, err = convert(base + ["--out", tmp_path / "o.ckpt", "--json", tmp_path / "o.ckpt"], capsys)
    one_error(rc, err, "to_mla", "--json")
    assert not (tmp_path / "o.ckpt").exists()


def test_errors_exit_2_in_one_line(src, tmp_path, readonly_dir, capsys):
    """Item 10: to_mla exited 1 (argparse's own errors 2, with a usage block)."""
    cases = [
        (["--model", src, "--out", tmp_path / "o.ckpt"], "give --d-latent"),
        (["--model", src, "--d-latent", "8", "--out", tmp_path], "is a directory"),
        (["--model", src, "--d-latent", "8", "--out", "."], "is a directory"),
        (["--model", src, "--d-latent", "8", "--out", readonly_dir / "o.ckpt"], "cannot write in"),
        (["--model", src, "--d-latent", "0", "--out", tmp_path / "o.ckpt"], "must be >= 1"),
        (["--model", src, "--d-latent", "8"], "--out"),
        (["--model", tmp_path / "missing.ckpt", "--d-latent", "8", "--out", tmp_path / "o.ckpt"], "not found"),
    ]
    for argv, expect in cases:
        rc, err = convert(argv, capsys)
        one_error(rc, err, "to_mla", expect)
    assert not (tmp_path / "o.ckpt").exists()


@pytest.mark.parametrize("name, value, expect", [
    ("nan", torch.full((96, 32), float("nan")), f"tensor {W} holds 3072 NaN/inf values"),
    ("int32", torch.ones(96, 32, dtype=torch.int32), f"tensor {W} has dtype int32"),
    ("bool", torch.ones(96, 32, dtype=torch.bool), f"tensor {W} has dtype bool"),
])
def test_source_tensors_are_checked(src, tmp_path, capsys, name, value, expect):
    bad = edit_ckpt(src, tmp_path / f"{name}.ckpt", W, value)
    rc, err = convert(["--model", bad, "--d-latent", "8", "--out", tmp_path / "o.ckpt"], capsys)
    assert str(bad) in one_error(rc, err, "to_mla", expect)
    assert not (tmp_path / "o.ckpt").exists()


def test_a_killed_runs_temporary_file_is_removed(src, tmp_path, capsys):
    out = tmp_path / "out.ckpt"
    stale = tmp_path / f".out.ckpt.{dead_pid()}.tmp"  # what atomic_save leaves when to_mla is killed mid-write
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f".out.ckpt.{os.getppid()}.tmp"  # a live process's write in progress
    live.write_bytes(b"x")
    other = tmp_path / f".other.ckpt.{dead_pid()}.tmp"  # another file's: not this command's business
    other.write_bytes(b"x")
    rc, err = convert(["--model", src, "--d-latent", "8", "--out", out], capsys)
    assert rc == 0, err
    assert not stale.exists() and live.exists() and other.exists()
    assert load_gpt_checkpoint(out)[1].d_latent == 8
