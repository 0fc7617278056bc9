"""training.config_checks: the parsed ``kvsplice train`` config is checked whole before anything is seeded, built
or printed: each bad value is one error naming the option as the user gave it (command line or ``--config``)."""

from __future__ import annotations

import os

import pytest
import torch
from jsonargparse import Namespace

from training.checkpoint import CheckpointError
from training.config_checks import check_parsed_config
from data.errors import DataConfigError
from training.lit import TrainingConfigError
from training.rundir import CLIConfigError


def _cfg(model=None, data=None, trainer=None, **top) -> Namespace:
    """A parsed config as KVSpliceCLI holds it: tiny_gpt2's values with ``model`` / ``data`` / ``trainer`` changes."""
    m = dict(vocab_multiple=1, learning_rate=2e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=1,
             min_lr_ratio=0.1, init_from=None, optimizer_impl="auto", compile=False, splice_lr_mult=1.0, n_layer=2,
             n_head=2, d_model=64, block_size=32, dropout=0.0, attention="mha", d_latent=32, kvsplice_keep=None,
             kvsplice_ratio=None)
    d = dict(path=None, val_path=None, tokenizer_path=None, dataset="x", synthetic=True, synthetic_stories=100,
             synthetic_vocab_size=512, bpe_vocab_size=None, batch_size=4, num_workers=0, cache_dir=".c",
             val_fraction=0.05, train_batches_per_epoch=10, val_batches=2, seed=1, block_size=32)
    t = dict(max_steps=10, accelerator="cpu", val_check_interval=5, check_val_every_n_epoch=None)
    ns = dict(seed_everything=1, torch_threads=None, ckpt_path=None)
    ns.update(top)
    return Namespace(model=Namespace(**{**m, **(model or {})}), data=Namespace(**{**d, **(data or {})}),
                     trainer=Namespace(**{**t, **(trainer or {})}), **ns)


def _never(option: str) -> bool:
    return False


def test_a_good_config_passes():
    check_parsed_config(_cfg(), _never)
    for interval in (0.25, 1.0, 100, "00:00:10:00"):  # a fraction, batches, a time: Lightning's three forms
        check_parsed_config(_cfg(trainer={"val_check_interval": interval}), _never)


@pytest.mark.parametrize("cfg, error, expect", [
    (_cfg(data={"batch_size": 0}), DataConfigError, "data.batch_size must be an integer >= 1, got 0"),
    (_cfg(data={"val_fraction": 1.5}), DataConfigError, "data.val_fraction"),
    (_cfg(model={"n_head": 3}), TrainingConfigError, "model.d_model must be divisible by n_head=3"),
    (_cfg(model={"kvsplice_ratio": 0.5}), TrainingConfigError, "model.kvsplice_ratio must be None unless"),
    (_cfg(model={"learning_rate": float("inf")}), TrainingConfigError, "model.learning_rate"),
    (_cfg(model={"learning_rate": 50.0}), TrainingConfigError, "model.learning_rate 50 is above 1"),
    (_cfg(trainer={"max_steps": -1}), TrainingConfigError, "trainer.max_steps must be set"),
    (_cfg(model={"d_model": 65536, "n_head": 1, "n_layer": 4096}), ValueError, "more than the"),
    (_cfg(torch_threads=10**6), ValueError, "--torch_threads must be <="),
    (_cfg(ckpt_path=7), CLIConfigError, "ckpt_path (in the --config file) must be a path"),
    # sizes bounded before Lightning starts (an OverflowError, a hang, a late error after start-up noise)
    (_cfg(trainer={"accumulate_grad_batches": 10**23}), CLIConfigError, "accumulate_grad_batches must be an integer "
                                                                         "in [1, 2^30]"),
    (_cfg(trainer={"max_steps": 10**23}), CLIConfigError, "--trainer.max_steps must be -1 (no limit) or at most"),
    (_cfg(trainer={"val_check_interval": "abc"}), CLIConfigError, "val_check_interval must be an integer number"),
    (_cfg(trainer={"val_check_interval": 1e23}), CLIConfigError, "val_check_interval must be an integer number"),
    (_cfg(trainer={"log_every_n_steps": 10**23}), CLIConfigError, "log_every_n_steps must be an integer in [0, 2^30]"),
    (_cfg(trainer={"gradient_clip_val": 1e12}), CLIConfigError, "gradient_clip_val must be null or a number in"),
    (_cfg(model={"weight_decay": 1e12}), TrainingConfigError, "model.weight_decay must be in [0, 10]"),
    (_cfg(data={"num_workers": 10**23}), DataConfigError, "data.num_workers must be at most 256"),
    (_cfg(data={"val_batches": 10**23}), DataConfigError, "data.val_batches must be at most 1,073,741,824"),
    (_cfg(data={"seed": 10**23}), DataConfigError, "data.seed must be at most 4,294,967,295"),
])
def test_a_bad_value_is_one_error_naming_it(cfg, error, expect):
    with pytest.raises(error) as e:
        check_parsed_config(cfg, _never)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_a_warmup_too_long_is_refused_when_given_and_shortened_when_not():
    cfg = _cfg(model={"warmup_steps": 10})
    check_parsed_config(cfg, _never)  # the run shortens it to 10 % of max_steps (with a note)
    with pytest.raises(TrainingConfigError, match=r"model.warmup_steps \(10\) must be smaller"):
        check_parsed_config(cfg, lambda option: option == "--model.warmup_steps")


class _Evil:
    def __reduce__(self):
        return os.system, ("echo pwned",)


@pytest.mark.parametrize("key, given, expect", [
    ("ckpt_path", False, "ckpt_path (in the --config file)"),
    ("ckpt_path", True, "--ckpt_path"),
    ("init_from", False, "model.init_from (in the --config file)"),
    ("init_from", True, "--model.init_from"),
])
def test_a_pickled_checkpoint_is_refused_naming_where_it_was_given(tmp_path, capfd, key, given, expect):
    evil = tmp_path / "evil.ckpt"
    torch.save({"payload": _Evil()}, evil)
    cfg = _cfg(model={"init_from": str(evil)}) if key == "init_from" else _cfg(ckpt_path=str(evil))
    with pytest.raises(CheckpointError) as e:
        check_parsed_config(cfg, lambda option: given)
    assert str(e.value).startswith(f"{expect} {evil}: refusing to load"), str(e.value)
    assert "pwned" not in capfd.readouterr().out


def test_a_text_file_as_checkpoint_is_one_error(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n" * 20)
    with pytest.raises(CheckpointError, match="not a valid PyTorch checkpoint"):
        check_parsed_config(_cfg(ckpt_path=str(text)), _never)


def test_seed_everything_true_draws_a_random_seed_silently(monkeypatch, capfd):
    from types import SimpleNamespace

    from training.lightning_cli import KVSpliceCLI

    seeds = []
    for _ in range(2):
        monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
        cli = SimpleNamespace(config=Namespace(seed_everything=True), _get=lambda cfg, key: cfg.get(key))
        KVSpliceCLI._set_seed(cli)
        seeds.append(cli.config["seed_everything"])
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]  # Lightning's own choice was 0 each time
    err = capfd.readouterr().err
    assert f"note: seed_everything: {seeds[1]}" in err and "Seed set" not in err
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    cli = SimpleNamespace(config=Namespace(seed_everything=7), _get=lambda cfg, key: cfg.get(key))
    KVSpliceCLI._set_seed(cli)
    assert cli.config["seed_everything"] == 7 and "Seed set" not in capfd.readouterr().err
