"""Bad input of every kind gives one ``PROG: error:`` line, exit status 2, no traceback, and
overwrites nothing — for ``python -m training.fit`` (66 inputs) and ``kvsplice evaluate`` (20 inputs); garbage
and empty text files are refused by :func:`data.sources.check_text_file` (used by the data module and by everything that
lists story files).

Runs are in-process (``main(argv)``) to stay fast; one subprocess case checks the real entry point.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import torch

from data import DataUnavailableError, train_bpe_tokenizer
from data.errors import BadTextError
from data.sources import check_text_file, list_story_files, text_defects
from models import GPT, GPTConfig
from training import evaluate
from training.checkpoint import CKPT_FORMAT, CKPT_FORMAT_KEY, GPT_CONFIG_KEY
from training.fit import main as fit_main
from tiny_models import TINY_FIT_ARGS as TINY

REPO = Path(__file__).resolve().parents[2]
SHARED_TS = REPO.parent / "shared" / "data" / "tinystories"


def _offline(monkeypatch) -> None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256 or 'dir'} of everything under ``folder``."""
    return {str(f.relative_to(folder)): (hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else "dir")
            for f in sorted(folder.rglob("*"))}


#: The error line of python -m training.fit / training.evaluate.
ERROR_LINE = re.compile(r"kvsplice (train|evaluate): error: ")


def check_one_line_error(rc: int, err: str, expect: str) -> None:
    errors = [line for line in err.splitlines() if ERROR_LINE.match(line)]
    assert rc == 2, f"exit {rc}\n{err[-3000:]}"
    assert len(errors) == 1, err[-3000:]
    assert expect in errors[0], errors[0]
    assert "Traceback" not in err, err[-3000:]
    assert ERROR_LINE.match(err.rstrip().splitlines()[-1]), err[-3000:]


# ------------------------------------------------------------------------------------------------ the text check
def test_check_text_file_refuses_garbage_and_empty(tmp_path):
    rand = tmp_path / "random.txt"
    rand.write_bytes(os.urandom(300_000))  # sampled at start, middle and end
    with pytest.raises(BadTextError, match=r"^calib='.*random.txt' does not look like text: \d+%"):
        check_text_file(rand, option="--calib")
    assert issubclass(BadTextError, DataUnavailableError)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(BadTextError, match=r"data.path='.*empty.txt' is an empty file"):
        check_text_file(empty)
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n\t\n")
    with pytest.raises(BadTextError, match="only whitespace"):
        check_text_file(blank)
    utf16 = tmp_path / "utf16.txt"
    utf16.write_bytes("Once upon a time there was a cat.\n".encode("utf-16") * 50)
    with pytest.raises(BadTextError, match="non-UTF-8"):
        check_text_file(utf16)
    with pytest.raises(DataUnavailableError, match="does not exist"):
        check_text_file(tmp_path / "missing.txt")
    # real text passes, whatever the script; a few bad characters (a cut multi-byte char) are tolerated
    good = tmp_path / "good.txt"
    good.write_bytes(("Once upon a time, über café 日本. <|endoftext|>\n" * 5000).encode() + b"\xe6\x97")
    assert check_text_file(good) == good
    assert text_defects(b"ok\x00\x1b\xff") == (5, 3)
    # list_story_files checks every file it lists (so every loader built on it refuses garbage)
    folder = tmp_path / "stories"
    folder.mkdir()
    (folder / "a.txt").write_text("One day a dog ran.\n\nThe end.")
    (folder / "b.txt").write_bytes(os.urandom(1000))
    with pytest.raises(BadTextError, match="b.txt"):
        list_story_files(folder, option="calib")
    assert list_story_files(folder / "a.txt") == [folder / "a.txt"]


@pytest.mark.skipif(not SHARED_TS.is_dir(), reason=f"no shared TinyStories samples at {SHARED_TS}")
def test_real_tinystories_files_pass_the_text_check():
    for f in sorted(SHARED_TS.iterdir()):
        assert check_text_file(f) == f


def test_d_latent_larger_than_d_model_refused():
    with pytest.raises(ValueError, match=r"GPTConfig.d_latent must be <= d_model=64"):
        GPTConfig(d_model=64, n_head=2, attention="mla", d_latent=128)
    GPTConfig(d_model=64, n_head=2, attention="mla", d_latent=64)  # equal is fine
    GPTConfig(d_model=64, n_head=2, attention="mha")  # MHA ignores d_latent (default 256)


# ------------------------------------------------------------------------------------------------ training.fit
@pytest.fixture(scope="module")
def fit_env(tmp_path_factory, data_cache):
    """A runs folder holding one finished tiny run (``tiny_gpt2``), a tokenizer, and bad files."""
    root = tmp_path_factory.mktemp("bad_fit")
    mp = pytest.MonkeyPatch()
    _offline(mp)
    runs = root / "runs"
    base = ["--config", "tiny_gpt2", *TINY, "--runs_dir", str(runs), "--data.cache_dir", str(data_cache),
            "--wandb.mode", "disabled", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
            "--model.warmup_steps", "1"]
    assert fit_main(base) == 0
    files = root / "files"
    files.mkdir()
    (files / "random.txt").write_bytes(os.urandom(50_000))
    (files / "empty.txt").write_bytes(b"")
    (files / "blank.txt").write_text("\n \n")
    (files / "empty.json").write_text("[]")
    (files / "garbage.yaml").write_bytes(os.urandom(400))
    (files / "list.yaml").write_text("- 1\n- 2\n")
    (files / "bad_key.yaml").write_text("model:\n  n_layers: 3\n")
    (files / "corrupt.ckpt").write_bytes(b"\x00garbage")
    (files / "a_file").write_text("x")
    (files / "empty_dir").mkdir()
    (files / "stories.txt").write_text("\n\n".join(["Once upon a time there was a little cat."] * 200))
    train_bpe_tokenizer(["once upon a time there was a cat"] * 20, vocab_size=300).save(files / "tok" /
                                                                                          "tokenizer.json")

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {root / 'pwned'}",)

    torch.save({"state_dict": {}, "payload": Evil()}, files / "evil.ckpt")
    yield base, runs, files, root
    mp.undo()


F = "FILES"  # replaced by the fixture's folder of bad files
#: (name, extra arguments after a valid tiny command, expected text in the error line)
BAD_FIT = [
    ("unknown flag", ["--model.n_layers", "3"], "n_layers"),
    ("wrong type", ["--model.n_layer", "three"], "model.n_layer"),
    ("bad choice", ["--model.attention", "gqa"], "model.attention"),
    ("float for int", ["--trainer.max_steps", "2.5"], "trainer.max_steps"),
    ("block_size 0", ["--model.block_size", "0"], "block_size"),
    ("block_size negative", ["--model.block_size", "-4"], "block_size"),
    ("block_size beyond the data", ["--model.block_size", "100000"], "too long for the data"),
    ("batch_size 0", ["--data.batch_size", "0"], "data.batch_size"),
    ("batch_size negative", ["--data.batch_size", "-3"], "data.batch_size"),
    ("n_layer 0", ["--model.n_layer", "0"], "model.n_layer"),
    ("n_head not dividing", ["--model.n_head", "3"], "model.d_model"),
    ("d_model negative", ["--model.d_model", "-8"], "model.d_model"),
    ("dropout 1.5", ["--model.dropout", "1.5"], "model.dropout"),
    ("d_latent > d_model", ["--model.attention", "mla", "--model.d_latent", "128"], "model.d_latent"),
    ("kvsplice_ratio 1.5", ["--model.attention", "mla", "--model.kvsplice_ratio", "1.5"], "model.kvsplice_ratio"),
    ("kvsplice without mla", ["--model.kvsplice_ratio", "0.3"], "model.kvsplice_ratio"),
    ("kvsplice_keep 1.5", ["--model.attention", "mla", "--model.kvsplice_keep", "1.5"], "model.kvsplice_keep"),
    ("kvsplice_keep 0", ["--model.attention", "mla", "--model.kvsplice_keep", "0"], "model.kvsplice_keep"),
    ("kvsplice_keep without mla", ["--model.kvsplice_keep", "0.3"], "model.kvsplice_keep"),
    ("negative lr", ["--model.learning_rate", "-1"], "model.learning_rate"),
    ("zero lr", ["--model.learning_rate", "0"], "model.learning_rate"),
    ("negative weight decay", ["--model.weight_decay", "-0.1"], "model.weight_decay"),
    ("negative warmup", ["--model.warmup_steps", "-1"], "model.warmup_steps"),
    ("explicit warmup >= max_steps", ["--model.warmup_steps", "2"], "model.warmup_steps (2) must be smaller"),
    ("min_lr_ratio 2", ["--model.min_lr_ratio", "2"], "model.min_lr_ratio"),
    ("beta >= 1", ["--model.betas", "[0.9, 1.5]"], "model.betas"),
    ("eps 0", ["--model.eps", "0"], "model.eps"),
    ("vocab_multiple 0", ["--model.vocab_multiple", "0"], "model.vocab_multiple"),
    ("flash on CPU", ["--model.attn_backend", "flash"], "model.attn_backend"),
    ("max_steps 0", ["--trainer.max_steps", "0"], "trainer.max_steps"),
    ("max_steps -1", ["--trainer.max_steps", "-1"], "trainer.max_steps"),
    ("accumulate 0", ["--trainer.accumulate_grad_batches", "0"], "accumulate_grad_batches"),
    ("val_check_interval 0", ["--trainer.val_check_interval", "0"], "val_check_interval"),
    ("check_val_every_n_epoch 0", ["--trainer.check_val_every_n_epoch", "0"], "check_val_every_n_epoch"),
    ("negative clip", ["--trainer.gradient_clip_val", "-1"], "gradient_clip_val"),
    ("negative log interval", ["--trainer.log_every_n_steps", "-1"], "log_every_n_steps"),
    ("devices 0", ["--trainer.devices", "0"], "devices"),
    ("max_epochs -2", ["--trainer.max_epochs", "-2"], "max_epochs"),
    ("negative seed", ["--seed_everything", "-5"], "seed_everything"),
    ("torch_threads 0", ["--torch_threads", "0"], "torch_threads"),
    ("torch_threads 100000", ["--torch_threads", "100000"], "--torch_threads must be <= "),
    ("run name with slash", ["--run_name", "a/b"], "--run_name"),
    ("runs_dir is a file", ["--runs_dir", f"{F}/a_file"], "--runs_dir"),
    ("overwrite and resume", ["--overwrite", "true", "--ckpt_path", "last"], "give only one"),
    ("best without best", ["--run_name", "other", "--ckpt_path", "best"], "no best"),
    ("missing checkpoint", ["--ckpt_path", "/nonexistent/x.ckpt"], "does not exist"),
    ("corrupt checkpoint", ["--ckpt_path", f"{F}/corrupt.ckpt"], "not a valid PyTorch checkpoint"),
    ("malicious checkpoint", ["--ckpt_path", f"{F}/evil.ckpt"], "refusing to load"),
    ("resume another model", ["--ckpt_path", "last", "--model.n_layer", "3"], "cannot resume"),
    ("missing config", ["--config", "no_such_config"], "no_such_config"),
    ("binary config", ["--config", f"{F}/garbage.yaml"], "not a text"),
    ("config not a mapping", ["--config", f"{F}/list.yaml"], "expected a mapping"),
    ("unknown key in config", ["--config", f"{F}/bad_key.yaml"], "n_layers"),
    ("random bytes as data", ["--data.synthetic", "false", "--data.path", f"{F}/random.txt"], "does not look like text"),
    ("empty data file", ["--data.synthetic", "false", "--data.path", f"{F}/empty.txt"], "empty file"),
    ("blank data file", ["--data.synthetic", "false", "--data.path", f"{F}/blank.txt"], "only whitespace"),
    ("empty stories list", ["--data.synthetic", "false", "--data.path", f"{F}/empty.json", "--data.tokenizer_path",
                            f"{F}/tok"], "no stories found"),
    ("missing data", ["--data.synthetic", "false", "--data.path", "/nonexistent/s.txt"], "does not exist"),
    ("folder without stories", ["--data.synthetic", "false", "--data.path", f"{F}/empty_dir"], "without .txt"),
    ("garbage validation file", ["--data.synthetic", "false", "--data.path", f"{F}/stories.txt", "--data.val_path",
                                 f"{F}/random.txt", "--data.tokenizer_path", f"{F}/tok"], "data.val_path"),
    ("garbage tokenizer", ["--data.synthetic", "false", "--data.path", f"{F}/stories.txt", "--data.tokenizer_path",
                           f"{F}/random.txt"], "data.tokenizer_path"),
    ("synthetic and path", ["--data.path", f"{F}/stories.txt"], "mutually exclusive"),
    ("hub offline", ["--data.synthetic", "false"], "data.path"),
    ("val_fraction 1.5", ["--data.val_fraction", "1.5"], "data.val_fraction"),
    ("negative workers", ["--data.num_workers", "-1"], "data.num_workers"),
    ("zero batches per epoch", ["--data.train_batches_per_epoch", "0"], "data.train_batches_per_epoch"),
    ("zero val batches", ["--data.val_batches", "0"], "data.val_batches"),
    ("tiny synthetic vocab", ["--data.synthetic_vocab_size", "10"], "data.synthetic_vocab_size"),
    ("cache_dir is a file", ["--data.cache_dir", f"{F}/a_file"], "data.cache_dir"),
    ("bad wandb mode", ["--wandb.mode", "foo"], "wandb.mode"),
    ("block_size 1e9", ["--model.block_size", "1000000000"], "--model.block_size 1000000000 with --data.batch_size"),
    ("batch_size 1e9", ["--data.batch_size", "1000000000"], "with --data.batch_size 1000000000: training"),
]


if not torch.cuda.is_available():  # on a CUDA machine asking for a GPU is not an error
    BAD_FIT.append(("no gpu", ["--trainer.accelerator", "gpu"], "gpu"))


def test_bad_fit_inputs_list_is_long():
    assert len(BAD_FIT) >= 25 and len({name for name, _, _ in BAD_FIT}) == len(BAD_FIT)


@pytest.mark.parametrize("name, extra, expect", BAD_FIT, ids=[c[0] for c in BAD_FIT])
def test_bad_fit_input_one_line_nothing_overwritten(name, extra, expect, fit_env, capsys):
    base, runs, files, root = fit_env
    extra = [a.replace(F, str(files)) for a in extra]
    before = snapshot(runs)
    capsys.readouterr()
    rc = fit_main(base + extra)
    check_one_line_error(rc, capsys.readouterr().err, expect)
    assert snapshot(runs) == before, "an earlier run's files changed (or a new run directory was left behind)"
    assert not (root / "pwned").exists(), "the malicious checkpoint ran code"


def test_bad_fit_input_through_the_real_entry_point(fit_env):
    base, runs, files, _ = fit_env
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "training.fit", *base, "--data.synthetic", "false", "--data.path",
                           str(files / "random.txt")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    check_one_line_error(proc.returncode, proc.stderr, "does not look like text")


# ------------------------------------------------------------------------------------------------ training.evaluate
@pytest.fixture(scope="module")
def eval_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_eval")
    data_hp = {"synthetic": True, "synthetic_stories": 300, "synthetic_vocab_size": 300,
               "cache_dir": str(root / "cache"), "block_size": 16}
    cfg = GPTConfig(vocab_size=300, n_layer=1, n_head=2, d_model=16, block_size=16, d_latent=8)
    ckpt = {CKPT_FORMAT_KEY: CKPT_FORMAT, GPT_CONFIG_KEY: cfg.to_dict(), "global_step": 1,
            "state_dict": {f"model.{k}": v for k, v in GPT(cfg).state_dict().items()},
            "datamodule_hyper_parameters": data_hp}
    files = root / "files"
    files.mkdir()
    torch.save(ckpt, files / "ok.ckpt")
    torch.save({"state_dict": {}, "hyper_parameters": {}}, files / "foreign.ckpt")
    (files / "corrupt.ckpt").write_bytes(b"\x00not a checkpoint" * 10)
    (files / "random.txt").write_bytes(os.urandom(20_000))
    (files / "out.json").write_text('{"earlier": "results"}')

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {root / 'pwned'}",)

    torch.save({"payload": Evil()}, files / "evil.ckpt")
    return files, root


OK = f"{F}/ok.ckpt"
BAD_EVAL = [
    ("no checkpoint", [], "--ckpt"),
    ("unknown option", ["--ckpt", OK, "--frobnicate"], "unrecognized arguments"),
    ("tokens 0", ["--ckpt", OK, "--tokens", "0"], "--tokens"),
    ("tokens not a number", ["--ckpt", OK, "--tokens", "abc"], "--tokens"),
    ("batch size 0", ["--ckpt", OK, "--batch-size", "0"], "--batch-size"),
    ("bad dtype", ["--ckpt", OK, "--dtype", "fp8"], "--dtype"),
    ("context 0", ["--ckpt", OK, "--context", "0"], "--context"),
    ("repeats 0", ["--ckpt", OK, "--repeats", "0"], "--repeats"),
    ("prompt length 0", ["--ckpt", OK, "--prompt-len", "0"], "--prompt-len"),
    ("negative sample tokens", ["--ckpt", OK, "--sample-tokens", "-1"], "--sample-tokens"),
    ("bad device", ["--ckpt", OK, "--device", "toaster"], "--device"),
    ("bad boolean", ["--ckpt", OK, "--data.synthetic", "maybe"], "--data.synthetic"),
    ("json exists", ["--ckpt", OK, "--json", f"{F}/out.json"], "already exists (use --force"),
    ("json is a folder", ["--ckpt", OK, "--json", F], "is a directory"),
    ("missing checkpoint", ["--ckpt", f"{F}/nope.ckpt"], "does not exist"),
    ("corrupt checkpoint", ["--ckpt", f"{F}/corrupt.ckpt"], "not a valid PyTorch checkpoint"),
    ("foreign checkpoint", ["--ckpt", f"{F}/foreign.ckpt"], "not a kvsplice training checkpoint"),
    ("malicious checkpoint", ["--ckpt", f"{F}/evil.ckpt"], "refusing to load"),
    ("random bytes as data", ["--ckpt", OK, "--data.path", f"{F}/random.txt"], "does not look like text"),
    ("missing data", ["--ckpt", OK, "--data.path", f"{F}/nope.txt"], "does not exist"),
]


@pytest.mark.parametrize("name, args, expect", BAD_EVAL, ids=[c[0] for c in BAD_EVAL])
def test_bad_evaluate_input_one_line_nothing_overwritten(name, args, expect, eval_env, capsys):
    files, root = eval_env
    args = [a.replace(F, str(files)) for a in args]
    before = snapshot(root)
    rc = evaluate.main(args)
    check_one_line_error(rc, capsys.readouterr().err, expect)
    assert snapshot(root) == before
    assert json.loads((files / "out.json").read_text()) == {"earlier": "results"}


def test_evaluate_json_force_replaces(eval_env, capsys):
    files, _ = eval_env
    out = files.parent / "forced" / "eval.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text("{}")
    args = ["--ckpt", str(files / "ok.ckpt"), "--tokens", "64", "--batch-size", "2", "--decode-tokens", "2",
            "--repeats", "1", "--sample-tokens", "2", "--cache-tokens", "8", "--context", "16", "--json", str(out)]
    assert evaluate.main(args) == 2
    assert out.read_text() == "{}"
    assert evaluate.main([*args, "--force"]) == 0
    assert json.loads(out.read_text())["rows"][0]["steps"] == 1
