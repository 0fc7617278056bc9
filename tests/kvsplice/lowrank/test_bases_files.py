"""The files the bases tools read and write (issues 22 and 31): :meth:`KVBases.load` refuses every malformed file
naming the file and the tensor (NaN/inf values made ``eval_bases`` print a table of ``nan``, int32 tensors were cast
and used); ``fit_bases`` / ``eval_bases`` exit 2 on every user error (they exited 1); their outputs never replace an
input — the calibration statistics included, even with ``--force`` (``--out S --calib-stats S`` replaced them) —,
statistics holding NaN / inf are refused (inf fitted bases anyway, NaN was a 43-line LinAlgError), a read-only
destination is one line, and a killed ``fit_bases``'s temporary file is removed by the next run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hostile import dead_pid, one_error, readonly_dir, snapshot, tiny_hf_with_bases  # noqa: F401
from kvsplice.cli import eval_bases, fit_bases
from kvsplice.lowrank.bases import BasesMismatchError, KVBases

STORY = "Once upon a time there was a little cat. The cat liked to play in the sun with a red ball."


@pytest.fixture(scope="module")
def env(tmp_path_factory, data_cache):
    """A tiny GPT-2 folder with its tokenizer, valid rank-4 bases for it and a small text."""
    d = tmp_path_factory.mktemp("bases")
    text = d / "text.txt"
    text.write_text("\n\n".join(f"{STORY} Day {i}." for i in range(60)))
    return (*tiny_hf_with_bases(d, data_cache), text)


def rewrite(src: Path, dst: Path, tensors=None, meta=None, drop=()) -> Path:
    """A copy of the bases file ``src`` with some tensors replaced / dropped and metadata entries changed."""
    with safe_open(str(src), framework="pt") as f:
        metadata = dict(f.metadata())
    data = {k: v for k, v in load_file(str(src)).items() if k not in drop}
    save_file({**data, **(tensors or {})}, str(dst), metadata={**metadata, **(meta or {})})
    return dst


H = "layers.1.heads.0."
BAD_FILES = {  # name: (tensors, metadata, dropped, text of the error)
    "nan": ({H + "v_enc": torch.full((16, 4), float("nan"))}, None, (), f"{H}v_enc holds 64 NaN/inf values"),
    "inf": ({H + "k_enc": torch.full((16, 4), float("-inf"))}, None, (), f"{H}k_enc holds 64 NaN/inf values"),
    "int32": ({H + "k_enc": torch.ones(16, 4, dtype=torch.int32)}, None, (), f"{H}k_enc has dtype int32"),
    "int64": ({H + "v_dec": torch.ones(16, 4, dtype=torch.int64)}, None, (), f"{H}v_dec has dtype int64"),
    "bool": ({H + "v_dec": torch.ones(16, 4, dtype=torch.bool)}, None, (), f"{H}v_dec has dtype bool"),
    "enc/dec shapes": ({H + "k_dec": torch.zeros(16, 3)}, None, (), f"{H}k_dec has shape (16, 3), expected (16, 4)"),
    "vector": ({H + "k_enc": torch.zeros(16), H + "k_dec": torch.zeros(16)}, None, (), f"{H}k_enc has shape (16,)"),
    "rank 0": ({H + "v_enc": torch.zeros(16, 0), H + "v_dec": torch.zeros(16, 0)}, None, (),
               f"{H}v_enc has shape (16, 0), expected (head_dim, rank)"),
    "head dims differ": ({H + "k_enc": torch.eye(12, 4), H + "k_dec": torch.eye(12, 4)}, None, (),
                         "the heads' key/value dims differ"),
    "missing tensor": (None, None, (H + "v_dec",), f"{H}v_dec"),
    "no layers": (None, {"n_layer": "0"}, (), "n_layer=0"),
    "not a number": (None, {"n_kv_head": "two"}, (), "cannot read bases"),
    "another format": (None, {"format_version": "7"}, (), "is not a kvsplice bases file"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_every_malformed_bases_file_is_refused(env, tmp_path, name):
    tensors, meta, drop, expect = BAD_FILES[name]
    bad = rewrite(env[1], tmp_path / "bad.safetensors", tensors, meta, drop)
    with pytest.raises(BasesMismatchError) as e:
        KVBases.load(bad)
    msg = str(e.value)
    assert expect in msg and str(bad) in msg and "\n" not in msg, msg
    assert KVBases.load(rewrite(env[1], tmp_path / "half.safetensors", {H + "k_enc": torch.eye(16, 4).half(),
                                                                        H + "k_dec": torch.eye(16, 4).half()}))


def run(cli, argv, capsys):
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_eval_bases_refuses_nan_bases_instead_of_a_nan_table(env, tmp_path, capsys):
    """Item 5."""
    model, good, text = env
    bad = rewrite(good, tmp_path / "nan.safetensors", BAD_FILES["nan"][0])
    rc, out, err = run(eval_bases, ["--model", model, "--bases", good, bad, "--data", text, "--tokens", 256,
                                    "--seq-len", 32, "--no-progress"], capsys)
    one_error(rc, err, "eval_bases", "holds 64 NaN/inf values")
    assert "nan" not in out.lower()


def test_errors_exit_2_and_outputs_never_replace_inputs(env, tmp_path, readonly_dir, capsys):
    """Item 10 (fit_bases / eval_bases exited 1) and the output rules."""
    model, good, text = env
    fit = ["--model", model, "--method", "ksvd", "--rank", 2, "--calib", text, "--calib-tokens", 256, "--seq-len", 32,
           "--no-progress", "--no-forward-timing"]
    ev = ["--model", model, "--bases", good, "--data", text, "--tokens", 256, "--seq-len", 32, "--no-progress"]
    before = snapshot(good.parent)
    cases = [
        (fit_bases, [*fit[:6], "--calib", tmp_path / "missing.txt", "--out", tmp_path / "b.safetensors"], "not found"),
        (fit_bases, [*fit, "--out", tmp_path / "b.safetensors", "--rank", 0], "must be >= 1"),
        (fit_bases, [*fit, "--out", tmp_path / "b.safetensors", "--bogus"], "unrecognized arguments"),
        (fit_bases, [*fit, "--out", text, "--force"], "is the input --calib"),
        (fit_bases, [*fit, "--out", model / "config.json", "--force"], "is a file of the input --model"),
        (fit_bases, [*fit, "--out", tmp_path / "b.safetensors", "--json", tmp_path / "b.safetensors"], "is also --out"),
        (fit_bases, [*fit, "--out", readonly_dir / "b.safetensors"], "cannot write in"),
        (fit_bases, [*fit, "--out", "."], "is a directory"),
        (eval_bases, [*ev, "--json", good, "--force"], "is the input --bases"),
        (eval_bases, [*ev, "--json", readonly_dir / "e.json"], "cannot write in"),
        (eval_bases, [*ev, "--chunk-size", 0], "must be >= 1"),
        (eval_bases, [*ev[:2], "--bases", tmp_path / "missing.safetensors", *ev[4:]], "bases file not found"),
    ]
    for cli, argv, expect in cases:
        rc, out, err = run(cli, argv, capsys)
        one_error(rc, err, cli.__name__.rsplit(".", 1)[1], expect)
    assert snapshot(good.parent) == before and not (tmp_path / "b.safetensors").exists()


def test_a_killed_fit_bases_temporary_file_is_removed(env, tmp_path, capsys):
    model, _, text = env
    out = tmp_path / "b.safetensors"
    stale = tmp_path / f".b.safetensors.{dead_pid()}.tmp"
    stale.write_bytes(b"half a file")
    rc, _, err = run(fit_bases, ["--model", model, "--method", "ksvd", "--rank", 2, "--calib", text, "--calib-tokens",
                                 256, "--seq-len", 32, "--no-progress", "--no-forward-timing", "--out", out], capsys)
    assert rc == 0, err
    assert not stale.exists() and KVBases.load(out).ranks()["k"] == [[2, 2]] * 2
    assert sorted(os.listdir(tmp_path)) == ["b.safetensors"]


def fit_args(env, *extra):
    model, _, text = env
    return ["--model", model, "--method", "ksvd", "--rank", 2, "--calib", text, "--calib-tokens", 256, "--seq-len",
            32, "--no-progress", "--no-forward-timing", *extra]


def test_the_calibration_statistics_are_never_replaced(env, tmp_path, capsys):
    stats = tmp_path / "s.safetensors"
    rc, _, err = run(fit_bases, fit_args(env, "--calib-stats", stats, "--out", stats), capsys)  # a new file: both
    one_error(rc, err, "fit_bases", "--calib-stats")
    assert not stats.exists()
    rc, _, err = run(fit_bases, fit_args(env, "--calib-stats", stats, "--out", tmp_path / "b.safetensors"), capsys)
    assert rc == 0, err
    digest = stats.read_bytes()
    for extra in (["--out", stats], ["--out", stats, "--force"], ["--out", tmp_path / "c.safetensors", "--json",
                                                                  stats, "--force"]):
        rc, _, err = run(fit_bases, fit_args(env, "--calib-stats", stats, *extra), capsys)
        one_error(rc, err, "fit_bases", f"is the input --calib-stats {stats}")
    assert stats.read_bytes() == digest and not (tmp_path / "c.safetensors").exists()


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_calibration_statistics_are_refused(env, tmp_path, capsys, value):
    stats = tmp_path / "s.safetensors"
    rc, _, err = run(fit_bases, fit_args(env, "--calib-stats", stats, "--out", tmp_path / "b.safetensors"), capsys)
    assert rc == 0, err
    with safe_open(str(stats), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(stats))
    name = sorted(n for n in tensors if n.endswith(".kk"))[0]
    tensors[name][0, 0, 1, 1] = value
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    rc, _, err = run(fit_bases, fit_args(env, "--calib-stats", bad, "--out", tmp_path / "x.safetensors"), capsys)
    one_error(rc, err, "fit_bases", f"tensor {name} holds 1 NaN/inf value")
    assert not (tmp_path / "x.safetensors").exists()
