"""Hostile inputs to ``python -m kvsplice.generate`` (issue 22): bases with NaN / inf / integer / misshapen tensors
and models with NaN weights are refused naming the file and the tensor (they printed empty or garbage text, exit 0),
a non-finite temperature is refused (``inf`` sampled uniform noise), a read-only ``--json`` folder and a
non-UTF-8 prompt are one line, and an exported remote-code folder is refused at once instead of stopping at
transformers' interactive ``[y/N]`` prompt."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hostile import one_error, readonly_dir, tiny_ckpt, tiny_hf_with_bases  # noqa: F401
from kvsplice import generate as cli
from models.generate import check_sampling, sample_next
from training.export import export

T = "layers.1.heads.0.k_dec"


@pytest.fixture(scope="module")
def hf(tmp_path_factory, data_cache):
    return tiny_hf_with_bases(tmp_path_factory.mktemp("gen"), data_cache)


def edit_bases(src: Path, dst: Path, name: str, value: torch.Tensor) -> Path:
    """A copy of the bases file ``src`` (metadata kept) with tensor ``name`` replaced by ``value``."""
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(src))
    tensors[name] = value
    save_file(tensors, str(dst), metadata=meta)
    return dst


def run(argv, capsys):
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name, value, expect", [
    ("nan", torch.full((16, 4), float("nan")), f"tensor {T} holds 64 NaN/inf values"),  # item 5
    ("inf", torch.full((16, 4), float("inf")), f"tensor {T} holds 64 NaN/inf values"),
    ("int32", torch.ones(16, 4, dtype=torch.int32), f"tensor {T} has dtype int32"),  # item 6
    ("shape", torch.zeros(16, 3), f"tensor {T} has shape (16, 3), expected (16, 4)"),
    ("vector", torch.zeros(16), f"tensor {T} has shape (16,), expected (16, 4)"),
])
def test_bad_bases_are_refused_naming_file_and_tensor(hf, tmp_path, capsys, name, value, expect):
    model, good = hf
    bad = edit_bases(good, tmp_path / f"{name}.safetensors", T, value)
    rc, out, err = run(["--model", model, "--bases", bad, "--prompt", "Once upon a time", "--max-new-tokens", 4],
                       capsys)
    assert str(bad) in one_error(rc, err, "generate", expect)
    assert out == ""  # no (empty or garbage) text


def test_rank_above_head_dim_is_refused(hf, tmp_path, capsys):
    model, good = hf
    wide = {n: torch.eye(16, 17) for n in ("k_enc", "k_dec")}
    bad = good
    for n, v in wide.items():
        bad = edit_bases(bad, tmp_path / f"wide_{n}.safetensors", f"layers.0.heads.1.{n}", v)
    rc, _, err = run(["--model", model, "--bases", bad, "--prompt", "Once", "--max-new-tokens", 2], capsys)
    one_error(rc, err, "generate", "has shape (16, 17), expected (head_dim, rank) with 1 <= rank <= head_dim")


def test_nan_weights_in_a_model_folder_are_refused(hf, tmp_path, capsys):
    src, _ = hf
    model = shutil.copytree(src, tmp_path / "nan")
    w = load_file(str(model / "model.safetensors"))
    w["transformer.h.0.mlp.c_fc.weight"][3, 5] = float("nan")
    save_file(w, str(model / "model.safetensors"), metadata={"format": "pt"})
    rc, out, err = run(["--model", model, "--prompt", "Once", "--max-new-tokens", 2], capsys)
    one_error(rc, err, "generate", "tensor transformer.h.0.mlp.c_fc.weight holds 1 NaN/inf value")
    assert out == ""


@pytest.mark.parametrize("temperature", ["inf", "-inf", "1e999", "nan", "-0.5"])
def test_non_finite_temperature_is_refused(hf, capsys, temperature):
    rc, out, err = run(["--model", hf[0], "--prompt", "Once", "--max-new-tokens", 2, f"--temperature={temperature}"],
                       capsys)
    one_error(rc, err, "generate", "--temperature: must be a finite number >= 0")
    logits = torch.randn(1, 10)
    with pytest.raises(ValueError, match="finite number >= 0"):
        sample_next(logits, float(temperature))  # the sampler itself refuses, whoever calls it
    with pytest.raises(ValueError, match="finite number >= 0"):
        check_sampling(2, float(temperature), None)


def test_json_destination_and_prompt_errors_are_one_line(hf, tmp_path, readonly_dir, capsys):
    model, bases = hf
    base = ["--model", model, "--prompt", "Once", "--max-new-tokens", 2]
    cases = [  # item 9: a read-only --json folder was a traceback after generating
        (["--json", readonly_dir / "out.json"], "cannot write in"),
        (["--json", bases, "--bases", bases, "--force"], "is the input --bases"),
        (["--json", model / "config.json", "--force"], "is a file of the input --model"),
        (["--json", tmp_path], "is a directory"),
    ]
    for extra, expect in cases:
        rc, out, err = run(base + extra, capsys)
        one_error(rc, err, "generate", expect)
        assert out == ""
    # item 10: bytes that are not UTF-8 reach sys.argv as lone surrogates (os.fsdecode)
    prompt = "Once upon a \udcff\udcfe time"
    rc, out, err = run(["--model", model, "--prompt", prompt, "--max-new-tokens", 2], capsys)
    one_error(rc, err, "generate", "--prompt is not valid UTF-8 text")


def test_remote_code_folder_is_refused_without_prompting(tmp_path, data_cache, capsys):
    """Item 10: transformers asked "Do you wish to run the custom code? [y/N]" and waited 15 s."""
    d = export(tiny_ckpt(tmp_path / "mla.ckpt", data_cache, attention="mla"), tmp_path / "remote")["out"]
    t0 = time.perf_counter()
    rc, out, err = run(["--model", d, "--prompt", "Once", "--max-new-tokens", 2], capsys)
    assert time.perf_counter() - t0 < 10
    one_error(rc, err, "generate", "holds custom model code")
    assert "[y/N]" not in out + err
