"""Short smoke runs of any config work; config lookup through
:class:`models.GPTConfig` relative to the package (any working directory), ``training/fit.py`` a thin entry point over
``training/lightning_cli.py`` / ``training/loggers.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import yaml

from models.config import CONFIG_DIR, ConfigNotFoundError, GPTConfig, available_configs, config_path
from training.checkpoint import load_checkpoint
from training.lightning_cli import shorten_schedule
from training.fit import main, config_file

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}


# ------------------------------------------------------------------------------------------------ config lookup
def test_gptconfig_from_name_and_file_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert CONFIG_DIR == REPO / "configs"
    cfg = GPTConfig.from_name("tiny_mla_kvsplice_90")
    assert (cfg.attention, cfg.kvsplice_keep, cfg.n_layer, cfg.d_model, cfg.d_latent) == ("mla", 0.1, 4, 128, 64)
    assert GPTConfig.from_name("mla_kvsplice_90.yaml") == GPTConfig.from_name("mla_kvsplice_90")
    assert GPTConfig.from_name("gpt2", vocab_size=50257).vocab_size == 50257
    big = GPTConfig.from_name("mla_kvsplice_70")  # learning_rate, warmup_steps, vocab_multiple... are ignored
    assert (big.n_layer, big.d_model, big.d_latent, big.kvsplice_keep) == (12, 768, 256, 0.3)
    assert config_path("tiny_gpt2") == CONFIG_DIR / "tiny_gpt2.yaml" and "tiny_gpt2" in available_configs()
    assert config_file("tiny_gpt2") == CONFIG_DIR / "tiny_gpt2.yaml"
    with pytest.raises(ConfigNotFoundError, match=r"no_such.*available: ds_mha, .*, gpt2, gpt2_gqa4, gpt2_mqa, mla, .*tiny_mla_kvsplice_90\)"):
        GPTConfig.from_name("no_such")

    own = tmp_path / "mine.yaml"  # a path works; a LightningCLI class_path/init_args section too
    own.write_text("model:\n  class_path: training.lit.LitGPT\n  init_args:\n    n_layer: 3\n    d_model: 96\n"
                   "    n_head: 4\n    learning_rate: 0.1\n")
    assert (GPTConfig.from_file(own).n_layer, GPTConfig.from_name(str(own)).d_model) == (3, 96)
    (tmp_path / "configs").mkdir()  # a configs/ folder in the cwd does not shadow the package's
    (tmp_path / "configs" / "tiny_gpt2.yaml").write_text("model:\n  n_layer: 7\n")
    assert GPTConfig.from_name("tiny_gpt2").n_layer == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layer: 0\n")
    with pytest.raises(ValueError, match=r"bad.yaml: GPTConfig.n_layer"):
        GPTConfig.from_file(bad)
    bad.write_text("trainer: {}\n")
    with pytest.raises(ValueError, match="no 'model:' section"):
        GPTConfig.from_file(bad)


def test_fit_config_names_resolve_from_another_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "training.fit", "--config", "tiny_gpt2", "--print_config"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["run_name"] == "tiny_gpt2"
    proc = subprocess.run([sys.executable, "-m", "training.fit", "--config", "nope"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("kvsplice train: error: --config 'nope'") and "available: ds_mha, " in line and "gpt2, gpt2_gqa4, gpt2_mqa, mla," in line


def test_fit_is_a_thin_entry_point():
    import training.lightning_cli
    import training.fit
    import training.loggers

    fit_src = Path(training.fit.__file__).read_text()
    assert "class " not in fit_src.replace("``", "")  # no classes (nested or not) left in the entry point
    assert training.fit.KVSpliceCLI is training.lightning_cli.KVSpliceCLI
    assert training.lightning_cli.RunCSVLogger is training.loggers.RunCSVLogger
    proc = subprocess.run([sys.executable, "-c", "import sys, training.fit; print('lightning' in sys.modules)"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", "importing the entry point should not import Lightning"


# ------------------------------------------------------------------------------------------------ short smoke runs
def test_shorten_schedule():
    assert shorten_schedule(500, 200, warmup_explicit=False)[0] == 20
    assert "10% of max_steps" in shorten_schedule(500, 200, warmup_explicit=False)[1]
    assert shorten_schedule(30, 300, warmup_explicit=False) == (30, None)  # fits: unchanged
    assert shorten_schedule(500, 200, warmup_explicit=True) == (500, None)  # explicit: check_schedule refuses it


def test_readme_smoke_run_of_a_full_config(tmp_path, data_cache, monkeypatch, capsys):
    """The README's ``--config mla_kvsplice_90 --trainer.max_steps 200 --model.kvsplice_ratio 0.3`` exited because
    the config's 500 warmup steps do not fit. Now the warmup is scaled (and validation moved to the run's end); run
    here with CPU-sized shapes, synthetic data and 5 steps (bf16 autocast, gradient accumulation 2 as configured)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    rc = main(["--config", "mla_kvsplice_90", "--trainer.max_steps", "5", "--model.kvsplice_ratio", "0.3",
               "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64", "--model.d_latent", "32",
               "--model.block_size", "64", "--data.synthetic", "true", "--data.synthetic_stories", "2000",
               "--data.synthetic_vocab_size", "512", "--data.batch_size", "4", "--data.val_batches", "2",
               "--data.num_workers", "0", "--data.cache_dir", str(data_cache), "--runs_dir", str(tmp_path),
               "--wandb.mode", "disabled", "--trainer.enable_progress_bar", "false"])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert "note: model.warmup_steps 500 does not fit trainer.max_steps 5: using warmup_steps 0" in err
    assert "note: trainer.val_check_interval 2000 is beyond this run's 10 training batches" in err
    # the old name on the command line overrides the config's kvsplice_keep: 0.1, with one note
    assert "note: model.kvsplice_ratio is the old name of kvsplice_keep" in err and "kvsplice_keep: 0.3" in err
    ckpt = load_checkpoint(tmp_path / "mla_kvsplice_90" / "last.ckpt")
    assert ckpt["global_step"] == 5 and ckpt["hyper_parameters"]["warmup_steps"] == 0
    assert ckpt["hyper_parameters"]["kvsplice_keep"] == ckpt["gpt_config"]["kvsplice_keep"] == 0.3
    saved = yaml.safe_load((tmp_path / "mla_kvsplice_90" / "config.yaml").read_text())["model"]
    assert saved["warmup_steps"] == 0 and saved["kvsplice_keep"] == 0.3 and "kvsplice_ratio" not in saved


# ------------------------------------------------------------------------------------------------ one-line errors
def test_a_bad_jsonl_line_is_one_line_naming_the_file_and_line(tmp_path, data_cache, capsys, monkeypatch):
    """``--data.path X.jsonl`` with a broken line 4 was a 58-line JSONDecodeError traceback saying "line 1"."""
    from hostile import one_error
    from tiny_models import TINY_FIT_ARGS as TINY
    from training.fit import PROG

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    stories = tmp_path / "stories.jsonl"
    good = [f'{{"text": "Once upon a time a cat named Tom found {i} red balls."}}' for i in range(40)]
    stories.write_text("\n".join([*good[:2], "", '{"text": "a story cut', *good[2:]]) + "\n")
    from data import train_bpe_tokenizer

    tok = tmp_path / "tok" / "tokenizer.json"
    train_bpe_tokenizer(["once upon a time there was a cat"] * 20, vocab_size=300).save(tok)
    runs = tmp_path / "runs"
    capsys.readouterr()
    rc = main(["--config", "tiny_gpt2", *TINY, "--runs_dir", str(runs), "--data.cache_dir", str(tmp_path / "cache"),
               "--wandb.mode", "disabled", "--trainer.max_steps", "2", "--data.synthetic", "false",
               "--data.path", str(stories), "--data.tokenizer_path", str(tok)])
    one_error(rc, capsys.readouterr().err, PROG, f"{stories}: line 4 is not valid JSON")
    assert not runs.exists()


def test_every_training_tool_names_itself_in_its_error_line(capsys):
    """``training.fit`` / ``training.evaluate`` printed ``error: ...`` without the program (kvsplice's tools print
    ``PROG: error: ...``)."""
    from hostile import one_error
    from training import evaluate, export, fit

    for module, argv in ((fit, ["--no-such-option", "1"]), (evaluate, ["--ckpt", "x.ckpt", "--tokens", "many"]),
                         (export, ["--ckpt", "x.ckpt"])):
        rc = module.main(argv)
        one_error(rc, capsys.readouterr().err, module.PROG)
