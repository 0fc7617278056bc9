"""Bad inputs to every ``kvsplice`` command-line tool: each gives one ``PROG: error: ...`` line (no traceback), a
non-zero exit status, and overwrites nothing. The list below is the documented set of refused inputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvsplice.cli import bench_balance, bench_decode, eval_bases, fit_bases, verify_memory
from hostile import prog_of

REPO = Path(__file__).resolve().parents[3]
DATA = REPO.parent / "shared" / "data"
STORIES = DATA / "stories260K"
TEXT = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
HAVE_DATA = all(p.is_file() for p in (STORIES / "stories260K.bin", STORIES / "tok512.bin", TEXT))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "garbage.txt").write_bytes(os.urandom(20000))
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("\n\n   \n")
    (d / "utf16.txt").write_text("Once upon a time there was a cat. " * 200, encoding="utf-16")
    (d / "existing.json").write_text('{"keep": "me"}\n')
    (d / "bases.safetensors").write_bytes(os.urandom(100))
    (d / "story.txt").write_text("Once upon a time there was a cat.\n\nThe cat was happy.\n")
    return d


@pytest.fixture(scope="module")
def s260k(tmp_path_factory):
    if not HAVE_DATA:
        pytest.skip(f"stories260K / TinyStories reference data not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))


def check_one_line(capsys, rc, prog, expect):
    out, err = capsys.readouterr()
    assert rc != 0, (prog, err)
    assert "Traceback" not in err + out, err
    lines = [ln for ln in err.splitlines() if ln.strip() and "warning" not in ln.lower()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog_of(prog)}: error: "), err
    assert expect.lower() in lines[0].lower(), (expect, lines[0])


# (tool, args, text expected in the one error line); {d} = the bad-files folder, {m} = the stories260K directory
NO_MODEL = [
    (verify_memory, "verify_memory", ["--seq-lens", "0"], "seq-lens"),
    (verify_memory, "verify_memory", ["--batch", "0"], "batch"),
    (verify_memory, "verify_memory", ["--config", "no_such_config"], "unknown config"),
    (verify_memory, "verify_memory", ["--config", "{d}/missing.yaml"], "not found"),
    (verify_memory, "verify_memory", ["--ckpt", "{d}/garbage.txt"], "cannot load checkpoint"),
    (verify_memory, "verify_memory", ["--json", "{d}/existing.json", "--config", "gpt2"], "already exists"),
    (verify_memory, "verify_memory", ["--dtype", "fp8"], "invalid choice"),
    (bench_decode, "bench_decode", ["--ctx", "0"], "must be >= 1"),
    (bench_decode, "bench_decode", ["--repeats", "0"], "must be >= 1"),
    (bench_decode, "bench_decode", ["--config", "nope"], "unknown config"),
    (bench_decode, "bench_decode", ["--json", "{d}/existing.json"], "already exists"),
    (fit_bases, "fit_bases", ["--model", "{d}/nope", "--method", "kq", "--rank", "2", "--calib", "{d}/story.txt",
                              "--out", "{d}/o.safetensors"], ""),
    (fit_bases, "fit_bases", ["--model", "{d}", "--method", "kq", "--rank", "2", "--calib", "{d}/story.txt",
                              "--out", "{d}/existing.json"], "already exists"),
    (eval_bases, "eval_bases", ["--model", "{d}/nope", "--bases", "{d}/missing.safetensors", "--data",
                                "{d}/story.txt"], "not found"),
    (eval_bases, "eval_bases", ["--model", "{d}/nope", "--bases", "{d}/bases.safetensors", "--data",
                                "{d}/story.txt", "--json", "{d}/existing.json"], "already exists"),
    (eval_bases, "eval_bases", ["--model", "{d}/nope", "--bases", "{d}/bases.safetensors", "--data",
                                "{d}/story.txt", "--prompt-len", "-5"], "--prompt-len must be >= 0, got -5"),
    # token counts are bounded before the model loads (a missing --model is not reached)
    (fit_bases, "fit_bases", ["--model", "{d}/nope", "--method", "kq", "--rank", "2", "--calib", "{d}/story.txt",
                              "--calib-tokens", "1000000000", "--out", "{d}/o.safetensors"],
     "--calib-tokens must be <= 16777216"),
    (fit_bases, "fit_bases", ["--model", "{d}/nope", "--method", "kq", "--rank", "2", "--calib", "{d}/story.txt",
                              "--calib-tokens", "65536", "--out", "{d}/o.safetensors"],
     "--calib-tokens 65536: --calib {d}/story.txt holds 54 B of text, at most 165 tokens"),
    (fit_bases, "fit_bases", ["--model", "{d}/nope", "--method", "kq", "--rank", "2", "--calib", "{d}",
                              "--calib-tokens", "100000", "--out", "{d}/o.safetensors"], "holds only whitespace"),
    (eval_bases, "eval_bases", ["--model", "{d}/nope", "--bases", "{d}/bases.safetensors", "--data",
                                "{d}/story.txt", "--tokens", "99999999999"], "--tokens must be <= 16777216"),
    (eval_bases, "eval_bases", ["--model", "{d}/nope", "--bases", "{d}/bases.safetensors", "--data",
                                "{d}/story.txt", "--tokens", "1000"], "holds 54 B of text, at most 165 tokens"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/story.txt", "--seeds", "0"], "seeds"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/story.txt", "--seeds", "99999999999"],
     "--seeds must be <= 1000"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/story.txt", "--n-sink", "-1"],
     "--n-sink must be >= 0"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/story.txt", "--T", "99"],
     "--T must be <= 30"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/story.txt", "--c-scale", "nan"],
     "--c-scale must be a finite number"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/story.txt", "--block-size", "3"],
     "block-size"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/garbage.txt"], "does not look like text"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/empty.txt"], "empty"),
    (bench_balance, "bench_balance", ["--model", "{d}/nope", "--data", "{d}/story.txt", "--json",
                                      "{d}/existing.json"], "already exists"),
]

WITH_MODEL = [
    (fit_bases, "fit_bases", ["--calib", "{d}/garbage.txt"], "does not look like text"),
    (fit_bases, "fit_bases", ["--calib", "{d}/empty.txt"], "empty"),
    (fit_bases, "fit_bases", ["--calib", "{d}/blank.txt"], "only whitespace"),
    (fit_bases, "fit_bases", ["--calib", "{d}/utf16.txt"], "does not look like text"),
    (fit_bases, "fit_bases", ["--calib", "{d}/story.txt", "--rank", "99"], "head_dim"),
    (fit_bases, "fit_bases", ["--calib", "{d}/story.txt", "--seq-len", "4096"], "positions"),
    (eval_bases, "eval_bases", ["--data", "{d}/garbage.txt"], "does not look like text"),
    (eval_bases, "eval_bases", ["--data", "{d}/empty.txt"], "empty"),
    (eval_bases, "eval_bases", ["--data", "{d}/story.txt", "--seq-len", "4096"], "positions"),
    (eval_bases, "eval_bases", ["--data", "{d}/story.txt", "--seq-len", "8", "--method", "fd-online", "--rank", "99"],
     "head_dim"),
    (fit_bases, "fit_bases", ["--calib", "{d}/story.txt", "--batch-size", "1000000000"],
     "--batch-size 1000000000 with --seq-len 512: a forward's logits needs about"),
    (fit_bases, "fit_bases", ["--calib", "{d}/story.txt", "--threads", "100000"], "--threads must be <= "),
    (eval_bases, "eval_bases", ["--data", "{d}/story.txt", "--batch-size", "1000000000"],
     "--batch-size 1000000000 with --seq-len 512: a forward's logits needs about"),
    (eval_bases, "eval_bases", ["--data", "{d}/story.txt", "--threads", "100000"], "--threads must be <= "),
]


def fmt(args, d, m=None):
    return [a.format(d=d, m=m) for a in args]


def _expect(expect, d):
    return expect.format(d=d) if "{d}" in expect else expect


@pytest.mark.parametrize("tool,prog,args,expect", NO_MODEL, ids=[f"{p}-{i}" for i, (_, p, *_r) in
                                                                    enumerate(NO_MODEL)])
def test_bad_input_without_a_model(tool, prog, args, expect, files, capsys):
    before = (files / "existing.json").read_text()
    try:
        rc = tool.main(fmt(args, files))
    except SystemExit as e:  # argparse choices/type errors exit 2 with argparse's own line
        rc = e.code
        out, err = capsys.readouterr()
        assert rc == 2 and "Traceback" not in err and expect in err, err
        return
    check_one_line(capsys, rc, prog, _expect(expect, files))
    assert (files / "existing.json").read_text() == before  # nothing overwritten


@pytest.mark.parametrize("tool,prog,args,expect", WITH_MODEL, ids=[f"{p}-{i}" for i, (_, p, *_r) in
                                                                      enumerate(WITH_MODEL)])
def test_bad_input_with_a_model(tool, prog, args, expect, files, s260k, capsys):
    if tool is fit_bases:
        base = ["--model", str(s260k), "--method", "kq", "--rank", "2", "--no-progress",
                "--out", str(files / "new.safetensors")]
    else:  # valid bases (checked before the model loads), so the error is the one under test
        bases = files / "valid.safetensors"
        if not bases.is_file():
            import transformers
            from test_hf_cache import random_bases

            random_bases(transformers.AutoModelForCausalLM.from_pretrained(s260k), 2, "post").save(bases)
            capsys.readouterr()  # the loading progress bar
        base = ["--model", str(s260k), "--bases", str(bases), "--no-progress"]
        if "--method" in args:
            base.remove("--bases")
            base.remove(str(bases))
    rc = tool.main(base + fmt(args, files))
    check_one_line(capsys, rc, prog, expect)
    assert not (files / "new.safetensors").exists()


def test_fit_bases_writes_files_with_the_usual_permissions(files, s260k, capsys):
    out = files / "perm.safetensors"
    rc = fit_bases.main(["--model", str(s260k), "--method", "kq", "--rank", "2", "--calib", str(TEXT),
                         "--calib-tokens", "1024", "--seq-len", "256", "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600
    assert not list(files.glob(".perm.safetensors.*"))  # no temp file left
