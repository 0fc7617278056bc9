"""Training: LitGPT (loss, optimiser groups, schedule, metrics), the ``python -m training.fit`` CLI (configs, resume,
real TinyStories files, DDP on CPU, one-line errors) and safe checkpoint loading.

CLI runs are subprocesses with tiny shapes, a shared data cache and the offline environment (no network needed).
"""

from __future__ import annotations

import csv
import importlib.util
import dataclasses
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from models import GPTConfig
from training.lit import LitGPT, TrainingConfigError, check_schedule, lr_factor, param_groups
from training.checkpoint import CheckpointError, load_checkpoint, load_gpt_checkpoint
from training.fit import CONFIG_DIR, CLIConfigError, prepare_args, config_file

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
TS_VAL = SHARED / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
GPT2_TOK = SHARED / "gpt2_tokenizer"

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "PYTHONWARNINGS": "ignore",
}
# Tiny shapes on top of any config: a few seconds per dozen steps on 2 CPU cores.
HAVE_WANDB = importlib.util.find_spec("wandb") is not None

TINY = [
    "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64", "--model.d_latent", "32",
    "--model.block_size", "64", "--data.batch_size", "8", "--data.val_batches", "4",
    "--data.synthetic_stories", "2000", "--data.synthetic_vocab_size", "512",
    "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "5",
]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def fit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "training.fit", *args]


def run_fit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(fit_cmd(*args), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"


# ------------------------------------------------------------------------------------------------------ unit tests
def test_litgpt_takes_the_gptconfig_fields_flat_as_the_cli_does(capsys):
    """``LitGPT(**config.to_dict(), ...)``: one form (no field repeated in its signature, no config object beside
    the fields); the command line has every GPTConfig field as ``--model.<field>`` with the dataclass's default,
    beside the training options, and builds the same module."""
    from training.fit import main

    params = inspect.signature(LitGPT.__init__).parameters
    fields = dataclasses.fields(GPTConfig)
    assert "config" not in params and not {f.name for f in fields} & set(params)
    assert main(["--config", "tiny_gpt2", "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model"]
    for f in fields:
        if f.name != "vocab_size":  # linked from the data module's tokenizer
            default = GPTConfig.from_name("tiny_gpt2").to_dict()[f.name]
            assert printed[f.name] == default, f.name
    assert printed["learning_rate"] == 2e-3 and "config" not in printed
    cfg = GPTConfig(vocab_size=50, n_layer=1, n_head=2, d_model=32, block_size=16, attention="mla", d_latent=16,
                    kvsplice_keep=0.5)
    flat = LitGPT(**cfg.to_dict(), learning_rate=1e-3)
    assert flat.config == cfg and flat.hparams["learning_rate"] == 1e-3
    with pytest.raises(TypeError):
        LitGPT(cfg)  # the config object is not a second way in


def test_the_old_key_kvsplice_ratio_is_read_as_kvsplice_keep(tmp_path):
    """``kvsplice_ratio`` (a kept fraction, while "ratio" elsewhere means "times smaller") is now ``kvsplice_keep``:
    files (a stored config, a YAML ``model:`` section, checkpoint hyper-parameters) may hold the old key, which
    :mod:`models.compat` reads as the new one and nothing writes; code (``GPTConfig(...)``) has the new name only."""
    new = GPTConfig(attention="mla", kvsplice_keep=0.1)
    with pytest.raises(TypeError, match="kvsplice_ratio"):
        GPTConfig(attention="mla", kvsplice_ratio=0.1)
    assert not hasattr(new, "kvsplice_ratio") and "kvsplice_ratio" not in new.to_dict()
    assert new.variant == "mla_kvsplice_90" and new.d_compressed == 26
    assert GPTConfig.from_dict({"attention": "mla", "kvsplice_ratio": 0.1}) == new  # a stored dict: read silently
    assert GPTConfig.from_dict({"attention": "mla", "kvsplice_ratio": 0.1, "kvsplice_keep": None}) == new
    with pytest.raises(ValueError, match="give only kvsplice_keep"):
        GPTConfig.from_dict({"attention": "mla", "kvsplice_ratio": 0.1, "kvsplice_keep": 0.5})
    flat = dict(vocab_size=50, n_layer=1, n_head=2, d_model=32, block_size=16, attention="mla", d_latent=16)
    lit = LitGPT(**flat, kvsplice_ratio=0.5)  # an earlier checkpoint's hyper-parameters
    assert lit.config.kvsplice_keep == 0.5 and "kvsplice_ratio" not in lit.hparams
    assert LitGPT(**flat, kvsplice_ratio=0.5, kvsplice_keep=0.25).config.kvsplice_keep == 0.25  # the CLI noted it
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  attention: mla\n  kvsplice_ratio: 0.1\n  learning_rate: 0.1\n")
    with pytest.warns(FutureWarning, match="old.yaml: kvsplice_ratio is the old name of kvsplice_keep"):
        assert GPTConfig.from_file(old) == new
    assert set(new.architecture()) == {f.name for f in dataclasses.fields(GPTConfig)} - {
        "dropout", "attn_backend", "mla_impl", "decode_kernel", "cache_quant"}


def test_a_config_file_with_the_old_key_trains_and_saves_the_new_one(tmp_path, data_cache, monkeypatch, capsys):
    from training.fit import main

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    text = (CONFIG_DIR / "tiny_mla_kvsplice_90.yaml").read_text()
    assert "  kvsplice_keep: 0.1" in text
    old = tmp_path / "mine.yaml"
    old.write_text(text.replace("  kvsplice_keep: 0.1", "  kvsplice_ratio: 0.1"))
    rc = main(["--config", str(old), *TINY, "--trainer.max_steps", "1", "--runs_dir", str(tmp_path / "runs"),
               "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled"])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert err.count("note: model.kvsplice_ratio is the old name of kvsplice_keep") == 1
    run = tmp_path / "runs" / "mine"
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert saved["kvsplice_keep"] == 0.1 and "kvsplice_ratio" not in saved
    assert load_gpt_checkpoint(run / "last.ckpt")[1].d_compressed == 3  # round(32 * 0.1): TINY's d_latent 32


def test_vocab_padding_and_config_errors():
    lit = LitGPT(vocab_size=50257, n_layer=1, n_head=2, d_model=32, block_size=16, vocab_multiple=64)
    assert lit.config.vocab_size == 50304
    with pytest.raises(TrainingConfigError, match="model.kvsplice_keep"):
        LitGPT(vocab_size=50, n_layer=1, n_head=2, d_model=32, block_size=16, kvsplice_keep=0.3)  # needs mla
    with pytest.raises(TrainingConfigError, match="model.kvsplice_ratio"):  # the name the user gave
        LitGPT(vocab_size=50, n_layer=1, n_head=2, d_model=32, block_size=16, kvsplice_ratio=0.3)
    with pytest.raises(TrainingConfigError, match="model.learning_rate"):
        LitGPT(vocab_size=50, n_layer=1, n_head=2, d_model=32, block_size=16, learning_rate=0.0)


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, 10, 100, 0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:10], f[1:10]))  # linear warmup increases
    assert all(a >= b for a, b in zip(f[10:100], f[11:101]))  # cosine decreases
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # half way: mid point of the cosine
    assert f[100] == pytest.approx(0.1) and f[119] == pytest.approx(0.1)
    with pytest.raises(TrainingConfigError, match="warmup_steps"):
        check_schedule(100, 100)
    with pytest.raises(TrainingConfigError, match="max_steps"):
        check_schedule(10, -1)


@pytest.mark.parametrize("orthogonal", [False, True])
def test_param_groups(orthogonal):
    lit = LitGPT(vocab_size=50, n_layer=2, n_head=2, d_model=32, block_size=16, attention="mla", d_latent=16,
                 kvsplice_keep=0.5, kvsplice_orthogonal=orthogonal)
    decay, no_decay = param_groups(lit.model, 0.1)
    names = {id(p): n for n, p in lit.model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "transformer.wte.weight" in decay_names  # embeddings (tied with lm_head) decay, as in nanoGPT
    assert "transformer.h.0.attn.w_dkv.weight" in decay_names
    assert all(n.endswith("bias") or ".ln_" in n or "ln_f" in n or "parametrizations" in n for n in no_decay_names)
    assert not any(n.endswith("bias") for n in decay_names)
    splice = [n for n in decay_names | no_decay_names if ".splice." in n]
    assert splice
    for n in splice:  # orthogonally parametrised KVSplice matrices never decay; free ones do
        assert (n in no_decay_names) == orthogonal
    assert len(decay_names) + len(no_decay_names) == len(list(lit.model.parameters()))


def _tiny_loader(n: int, t: int, vocab: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # a learnable sequence: every token is the previous one + 1 (mod vocab)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    seq = (start + torch.arange(t + 1)) % vocab  # (n, t+1)
    ds = torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:])
    return torch.utils.data.DataLoader(ds, batch_size=batch)


def _trainer(**kw):
    import lightning as L

    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0)
    base.update(kw)
    return L.Trainer(**base)


@pytest.mark.parametrize("orthogonal", [False, True])
def test_training_changes_kvsplice_weights(orthogonal):
    torch.manual_seed(0)
    lit = LitGPT(vocab_size=37, n_layer=2, n_head=2, d_model=32, block_size=16, attention="mla", d_latent=16,
                 kvsplice_keep=0.3, kvsplice_orthogonal=orthogonal, learning_rate=3e-3, warmup_steps=2)
    splice = lit.model.transformer.h[0].attn.splice
    before = {k: v.clone() for k, v in lit.model.state_dict().items() if ".splice." in k}
    c0, e0 = splice.compress_weight().detach().clone(), splice.expand_weight().detach().clone()
    assert before
    _trainer(max_steps=8, limit_val_batches=0).fit(lit, _tiny_loader(64, 16, 37, 8))
    after = {k: v for k, v in lit.model.state_dict().items() if ".splice." in k}
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no KVSplice parameter changed"
    assert not torch.allclose(splice.compress_weight(), c0), "compress did not train"
    assert not torch.allclose(splice.expand_weight(), e0), "expand did not train"
    if orthogonal:  # still orthonormal after training
        c = splice.compress_weight().detach()
        torch.testing.assert_close(c @ c.T, torch.eye(c.shape[0]), atol=1e-4, rtol=0)


def test_val_loss_is_token_weighted_mean_and_ppl():
    """val_loss = mean over ALL validation tokens (uneven last batch), val_ppl = exp(val_loss)."""
    torch.manual_seed(0)
    lit = LitGPT(vocab_size=23, n_layer=1, n_head=2, d_model=16, block_size=8)
    loader = _tiny_loader(10, 8, 23, 4, seed=1)  # batches of 4, 4, 2 sequences
    out = _trainer().validate(lit, loader, verbose=False)[0]
    lit.eval()
    with torch.no_grad():
        total, n = 0.0, 0
        for x, y in loader:
            logits = lit.model(x)
            total += torch.nn.functional.cross_entropy(logits.view(-1, 23), y.reshape(-1), reduction="sum").item()
            n += y.numel()
    assert out["val_loss"] == pytest.approx(total / n, rel=1e-5)
    assert out["val_ppl"] == pytest.approx(math.exp(total / n), rel=1e-5)


# ------------------------------------------------------------------------------------------------------ configs
def test_config_name_resolution(tmp_path):
    assert config_file("tiny_gpt2") == CONFIG_DIR / "tiny_gpt2.yaml"
    assert config_file("tiny_gpt2.yaml") == CONFIG_DIR / "tiny_gpt2.yaml"
    own = tmp_path / "mine.yaml"
    own.write_text("trainer:\n  max_steps: 3\n")
    assert config_file(str(own)) == own
    args, stem = prepare_args(["fit", "--config=mla_kvsplice_90", "--trainer.max_steps", "200", "-c", str(own)])
    assert args == ["--config", str(CONFIG_DIR / "mla_kvsplice_90.yaml"), "--trainer.max_steps", "200",
                    "--config", str(own)]
    assert stem == "mla_kvsplice_90"
    with pytest.raises(CLIConfigError, match="no such file"):
        config_file("no_such_config")


FULL = ["gpt2", "mla", "mla_kvsplice_50", "mla_kvsplice_70", "mla_kvsplice_90"]
ATTN = {"gpt2": ("mha", None), "mla": ("mla", None), "mla_kvsplice_50": ("mla", 0.5),
        "mla_kvsplice_70": ("mla", 0.3), "mla_kvsplice_90": ("mla", 0.1)}


@pytest.mark.parametrize("prefix", ["", "tiny_"])
def test_configs_differ_only_in_attention(prefix):
    loaded = {n: yaml.safe_load((CONFIG_DIR / f"{prefix}{n}.yaml").read_text()) for n in FULL}
    for n, cfg in loaded.items():
        assert (cfg["model"]["attention"], cfg["model"]["kvsplice_keep"]) == ATTN[n]
        text = (CONFIG_DIR / f"{prefix}{n}.yaml").read_text()
        assert text.startswith("#") and f"python -m training.fit --config {prefix}{n}" in text
    stripped = []
    for cfg in loaded.values():
        cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
        attention = cfg["model"].pop("attention")
        cfg["model"].pop("kvsplice_keep")
        # the 124M MLA configs normalise the latent (the frontier study's default); the tiny ones keep the recorded run
        assert cfg["model"].pop("latent_norm", False) is (attention == "mla" and prefix == "")
        stripped.append(cfg)
    assert all(s == stripped[0] for s in stripped[1:])
    if prefix == "tiny_":
        assert stripped[0]["data"]["synthetic"] is True and stripped[0]["trainer"]["precision"] == "32-true"
    else:
        m = stripped[0]["model"]
        assert (m["n_layer"], m["n_head"], m["d_model"], m["block_size"], m["d_latent"]) == (12, 12, 768, 1024, 256)
        assert stripped[0]["trainer"]["precision"] == "bf16-mixed"


SMALL = {"small_mha": ("mha", None, None, 128), "small_gqa2": ("mha", 2, None, 128), "small_mqa": ("mha", 1, None, 128),
         "small_mla": ("mla", None, None, 128), "small_mla_64": ("mla", None, None, 64),
         "small_mla_32": ("mla", None, None, 32), "small_mla_kvsplice_50": ("mla", None, 0.5, 128),
         "small_mla_kvsplice_70": ("mla", None, 0.3, 128), "small_mla_kvsplice_90": ("mla", None, 0.1, 128)}


def test_small_configs_differ_only_in_attention():
    """The frontier study's configs: equal data, schedule and shapes; only the attention fields differ."""
    stripped = []
    for name, (attention, kv, ratio, latent) in SMALL.items():
        cfg = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
        m = cfg["model"]
        got = (m.pop("attention"), m.pop("n_kv_head", None), m.pop("kvsplice_keep", None), m.pop("d_latent"))
        assert got == (attention, kv, ratio, latent), name
        assert m.pop("latent_norm") is (attention == "mla")
        stripped.append(cfg)
    assert all(s == stripped[0] for s in stripped[1:])
    assert stripped[0]["data"]["bpe_vocab_size"] == 4096 and stripped[0]["trainer"]["precision"] == "32-true"


@pytest.mark.parametrize("name", sorted(c.stem for c in CONFIG_DIR.glob("*.yaml")))
def test_all_configs_parse(name, capsys):
    """Every config is accepted by the CLI parser (``--print_config`` parses and exits before building anything)."""
    from training.fit import main

    assert main(["--config", name, "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["run_name"] == name
    assert printed["trainer"]["max_steps"] > printed["model"]["warmup_steps"]


# ------------------------------------------------------------------------------------------------------ CLI runs
def test_fit_resume_and_checkpoints(tmp_path, data_cache):
    """A tiny KVSplice config trains, validation loss falls, checkpoints/config/metrics/wandb are written, and
    ``--ckpt_path last`` continues the step count, optimiser state and schedule."""
    common = ["--config", "tiny_mla_kvsplice_70", *TINY, "--runs_dir", str(tmp_path), "--data.cache_dir",
              str(data_cache), "--trainer.val_check_interval", "10", "--model.warmup_steps", "5",
              *([] if HAVE_WANDB else ["--wandb.mode", "disabled"])]
    proc = run_fit(*common, "--trainer.max_steps", "30")
    assert_ok(proc)
    run = tmp_path / "tiny_mla_kvsplice_70"  # run name defaults to the config's file name
    assert (run / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    assert len(list(run.glob("best-*.ckpt"))) == 1
    if HAVE_WANDB:  # a declared dependency; an environment without it (a bare GPU image) runs the rest
        assert list((run / "wandb").glob("offline-run-*")), "no offline W&B run"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["kvsplice_keep"] == 0.3 and saved["trainer"]["max_steps"] == 30
    assert "kvsplice_ratio" not in saved["model"]  # the old name is read, never written

    rows = read_metrics(run)
    val = column(rows, "val_loss")
    assert [s for s, _ in val] == [9, 19, 29]
    assert val[-1][1] < val[0][1], f"validation loss did not decrease: {val}"
    assert column(rows, "val_ppl")[-1][1] == pytest.approx(math.exp(val[-1][1]), rel=1e-4)
    assert column(rows, "tokens_per_sec") and column(rows, "train_loss")

    ckpt = load_checkpoint(run / "last.ckpt")
    assert ckpt["global_step"] == 30
    assert ckpt["optimizer_states"][0]["state"][0]["step"].item() == 30
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 30
    model, cfg, meta = load_gpt_checkpoint(run / "last.ckpt")
    assert cfg.variant == "mla_kvsplice_70" and cfg.d_compressed == round(32 * 0.3)
    assert meta["global_step"] == 30 and cfg.vocab_size <= 512  # the synthetic BPE's vocabulary, linked from data
    assert model.transformer.h[0].attn.splice is not None

    proc = run_fit(*common, "--trainer.max_steps", "40", "--ckpt_path", "last")
    assert_ok(proc)
    ckpt2 = load_checkpoint(run / "last.ckpt")
    assert ckpt2["global_step"] == 40  # continued from 30, not restarted
    assert ckpt2["optimizer_states"][0]["state"][0]["step"].item() == 40
    assert ckpt2["lr_schedulers"][0]["last_epoch"] == 40
    assert ckpt2["kvsplice_train_stats"]["tokens"] > ckpt["kvsplice_train_stats"]["tokens"]
    rows = read_metrics(run)  # earlier rows kept, new ones appended
    assert [s for s, _ in column(rows, "val_loss")] == [9, 19, 29, 39]


@pytest.mark.skipif(not (TS_VAL.is_file() and GPT2_TOK.is_dir()), reason=f"no shared TinyStories data at {SHARED}")
def test_fit_on_real_tinystories_with_gpt2_tokenizer(tmp_path):
    proc = run_fit("--config", "tiny_gpt2", *TINY, "--runs_dir", str(tmp_path), "--run_name", "real",
                   "--data.synthetic", "false", "--data.path", str(TS_VAL), "--data.tokenizer_path", str(GPT2_TOK),
                   "--data.cache_dir", str(tmp_path / "cache"), "--trainer.max_steps", "4",
                   "--trainer.val_check_interval", "4", "--model.warmup_steps", "1", "--wandb.mode", "disabled")
    assert_ok(proc)
    model, cfg, meta = load_gpt_checkpoint(tmp_path / "real" / "last.ckpt")
    assert cfg.vocab_size == 50257 and meta["global_step"] == 4
    val = column(read_metrics(tmp_path / "real"), "val_loss")
    assert val and math.isfinite(val[-1][1]) and val[-1][1] < math.log(50257)


def test_fit_ddp_two_processes_on_cpu(tmp_path, data_cache):
    proc = run_fit("--config", "tiny_gpt2", *TINY, "--runs_dir", str(tmp_path), "--run_name", "ddp",
                   "--data.cache_dir", str(data_cache), "--trainer.devices", "2", "--trainer.strategy", "ddp",
                   "--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--model.warmup_steps", "1",
                   "--wandb.mode", "disabled")
    assert_ok(proc)
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["ddp"]  # rank 1 used the folder rank 0 took (no ddp-v1)
    ckpt = load_checkpoint(tmp_path / "ddp" / "last.ckpt")
    assert ckpt["global_step"] == 4


# ------------------------------------------------------------------------------------------------------ errors
class _Evil:
    """Unpickling this runs ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Opaque:
    """An arbitrary class instance (not code, but not allowed by weights_only either)."""

    def __init__(self) -> None:
        self.x = 1


def test_malicious_and_corrupt_checkpoints_refused_in_process(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Evil(marker)}, evil)
    assert not marker.exists()
    for loader in (load_checkpoint, load_gpt_checkpoint):
        with pytest.raises(CheckpointError, match="refusing to load .*pickled code"):
            loader(evil)
    assert not marker.exists(), "the malicious checkpoint ran code"
    opaque = tmp_path / "opaque.ckpt"
    torch.save({"hyper_parameters": _Opaque()}, opaque)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(opaque)
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a valid PyTorch checkpoint"):
        load_gpt_checkpoint(corrupt)
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, other)
    with pytest.raises(CheckpointError, match="not a kvsplice training checkpoint"):
        load_gpt_checkpoint(other)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gpt_checkpoint(tmp_path / "missing.ckpt")


def _check_one_line_error(name: str, rc: int, err: str, expect: str) -> None:
    assert rc == 2, f"{name}: exit {rc}\n{err[-3000:]}"
    errors = [line for line in err.splitlines() if line.startswith("kvsplice train: error:")]
    assert len(errors) == 1, f"{name}: {err[-3000:]}"
    assert expect in errors[0], f"{name}: {errors[0]}"
    assert "Traceback" not in err, f"{name}: {err[-3000:]}"
    assert err.rstrip().splitlines()[-1].startswith("kvsplice train: error:"), f"{name}: last line is not the error\n{err}"


def _base_args(tmp_path: Path, data_cache: Path) -> list[str]:
    return ["--config", "tiny_gpt2", *TINY, "--runs_dir", str(tmp_path / "runs"), "--data.cache_dir",
            str(data_cache), "--wandb.mode", "disabled", "--trainer.max_steps", "5", "--model.warmup_steps", "1"]


def test_cli_errors_subprocess(tmp_path, data_cache):
    """Through ``python -m training.fit`` (offline env): exit 2, exactly one ``kvsplice train: error:`` line, no
    traceback."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Evil(marker)}, evil)
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text("model:\n  n_layers: 3\n")
    cases = {
        "unknown key in yaml": (["--config", str(bad_key)], "n_layers"),
        "hub offline": (["--data.synthetic", "false"], "data.path"),
        "malicious checkpoint": (["--ckpt_path", str(evil)], "refusing to load"),
    }
    procs = {name: subprocess.Popen(fit_cmd(*_base_args(tmp_path, data_cache), *extra), cwd=REPO, env=ENV,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (extra, _) in cases.items()}
    for name, p in procs.items():
        _, err = p.communicate(timeout=240)
        _check_one_line_error(name, p.returncode, err, cases[name][1])
    assert not marker.exists(), "the malicious checkpoint ran code"


@pytest.mark.parametrize("name, extra, expect", [
    ("unknown flag", ["--model.n_layers", "3"], "n_layers"),
    ("wrong type", ["--model.n_layer", "three"], "model.n_layer"),
    ("bad choice", ["--model.attention", "gqa"], "model.attention"),
    ("wrong type in data", ["--data.batch_size", "big"], "data.batch_size"),
    ("warmup >= max_steps", ["--model.warmup_steps", "5"], "warmup_steps"),
    ("no max_steps", ["--trainer.max_steps", "-1"], "max_steps"),
    ("kvsplice without mla", ["--model.kvsplice_ratio", "0.3"], "model.kvsplice_ratio"),
    ("kvsplice_keep without mla", ["--model.kvsplice_keep", "0.3"], "model.kvsplice_keep"),
    ("missing config", ["--config", "no_such_config"], "no_such_config"),
    ("missing data path", ["--data.synthetic", "false", "--data.path", "/nonexistent/stories.txt",
                           "--data.tokenizer_path", "TOKENIZER"], "data.path='/nonexistent/stories.txt'"),
    ("hub offline, no tokenizer", ["--data.synthetic", "false", "--data.path", "STORIES"], "data.tokenizer_path"),
    ("corrupt checkpoint", ["--ckpt_path", "CORRUPT"], "not a valid PyTorch checkpoint"),
    ("missing checkpoint", ["--ckpt_path", "/nonexistent/x.ckpt"], "does not exist"),
])
def test_cli_errors_in_process(name, extra, expect, tmp_path, data_cache, capsys, monkeypatch):
    """The same error handling, calling ``training.fit.main`` directly (fast: no interpreter start-up)."""
    from training.fit import main

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    if "CORRUPT" in extra:
        corrupt = tmp_path / "corrupt.ckpt"
        corrupt.write_bytes(b"\x00garbage")
        extra = [str(corrupt) if a == "CORRUPT" else a for a in extra]
    if "STORIES" in extra:
        stories = tmp_path / "stories.txt"
        stories.write_text("Once upon a time there was a cat.\n\nThe cat sat on a mat.")
        extra = [str(stories) if a == "STORIES" else a for a in extra]
    if "TOKENIZER" in extra:
        from data import train_bpe_tokenizer

        tok = tmp_path / "tok" / "tokenizer.json"
        train_bpe_tokenizer(["once upon a time there was a cat"] * 20, vocab_size=300).save(tok)
        extra = [str(tok) if a == "TOKENIZER" else a for a in extra]
    rc = main(_base_args(tmp_path, data_cache) + extra)
    _check_one_line_error(name, rc, capsys.readouterr().err, expect)
