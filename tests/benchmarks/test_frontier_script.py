"""The frontier studies' bookkeeping (benchmarks.lib.study and its report benchmarks.lib.seed_report, used by
benchmarks/frontier.py and kvsplice_recipe.py): cache measurement from a checkpoint, the Pareto front, seed statistics,
the late-loss-drop figure, resume keys and the children of a killed study (the long studies themselves run outside
the test suite)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from models.checkpoint import save_model
from models.config import GPTConfig
from models.gpt import GPT
from benchmarks.harness import report, studies
from benchmarks.harness.paths import TINYSTORIES
from benchmarks.lib import seed_report, study
from processes import wait_ended, watch
from tiny_models import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "frontier.py"


@pytest.fixture(scope="module")
def frontier():
    return load_benchmark("frontier")


@pytest.mark.parametrize("kw, per_layer", [(dict(), 2 * 32), (dict(n_kv_head=1), 2 * 8),
                                           (dict(attention="mla", d_latent=12), 12),
                                           (dict(attention="mla", d_latent=12, kvsplice_keep=0.5), 6)])
def test_cache_bytes_from_a_checkpoint(tmp_path: Path, frontier, kw, per_layer) -> None:
    model = GPT(GPTConfig(vocab_size=50, n_layer=3, n_head=4, d_model=32, block_size=64, **kw))
    ckpt = save_model(model, tmp_path / "m.ckpt")
    got = study.cache_bytes(ckpt, 40)
    assert got["cache_bytes_per_token"] == 3 * per_layer * 2  # fp16, all layers
    assert got["cache_bytes_per_token_fp32"] == 3 * per_layer * 4
    assert got["cache_dim"] == per_layer


def _row(variant: str, seed: int, loss: float, nbytes: float) -> dict:
    curve = [[s, 5.0 - s / 100] for s in range(20, 101, 20)]  # falls 0.2 per 20 steps
    return {"variant": variant, "seed": seed, "val_loss": loss, "cache_bytes_per_token": nbytes, "tokens": 1000,
            "steps": 500, "train_loss_curve": curve}


class _Run:
    """What the report reads of a run: its steps and batch, device, study and machine."""

    args = SimpleNamespace(device="cpu", study="frontier")
    header = {"machine": {"processor": "x86_64", "cores": 2}}

    def __getitem__(self, key: str) -> int:
        return {"steps": 500, "batch": 8}[key]


def test_summary_pareto_and_spread(frontier) -> None:
    rows = [_row("mha", s, 3.0 + 0.1 * s, 2048) for s in (1, 2, 3)]
    rows += [_row("mla", s, 3.05, 512) for s in (1, 2, 3)]
    rows += [_row("mqa", s, 3.3, 512) for s in (1, 2, 3)]  # same bytes as mla, higher loss: dominated
    rows += [_row("tiny", s, 3.5, 64) for s in (1, 2)]
    summary = {s["variant"]: s for s in seed_report.summarise(rows)}
    assert math.isclose(summary["mha"]["val_loss"], 3.2) and math.isclose(summary["mha"]["std"], 0.1)
    assert summary["mla"]["std"] == 0.0 and summary["tiny"]["n"] == 2
    assert [v for v, s in summary.items() if s["pareto"]] == ["mla", "tiny"]  # mha: mla is smaller and better
    assert math.isclose(summary["mla"]["late_drop"], 0.2)  # mean of step 80 minus mean of step 100
    md = report.markdown(studies.load("frontier")["report"], rows, seed_report.report_rows(_Run(), rows))
    assert "| mla | 512 | 0.250× | 3.0500 ± 0.0000 | 3 |" in md and "ratios against mha" in md
    assert "| mqa | mla | +0.2500 | 0.0000 | - | no SE (one seed each) |" in md  # equal bytes, no spread


def test_late_drop_flat_and_short_curves(frontier) -> None:
    assert seed_report.late_drop([[s, 2.0] for s in range(10, 101, 10)]) == 0.0
    assert seed_report.late_drop([]) is None and seed_report.late_drop([[100, 2.0]]) is None


def test_last_val_and_curve_from_metrics(tmp_path: Path, frontier) -> None:
    m = tmp_path / "metrics.csv"
    m.write_text("epoch,lr,step,tokens,tokens_per_sec,train_loss,train_time_s,val_loss,val_ppl\n"
                 "0,0.1,19,40960.0,5000,6.1,8.0,,\n0,0.1,39,81920.0,5000,5.5,16.0,,\n0,,39,,,,,5.2,181.3\n")
    assert study.last_val(m) == (39, 5.2, 81920.0, 16.0)
    assert study.train_curve(m) == [[20, 6.1], [40, 5.5]]
    m.write_text("epoch,lr,step,tokens,tokens_per_sec,train_loss,train_time_s,val_loss,val_ppl\n0,,4,,,,,6.7,812.0\n")
    assert study.last_val(m) == (4, 6.7, None, None)  # shorter than the logging interval (short fine-tunes)


def test_trained_tokens_count_every_step_not_the_logged_ones(tmp_path: Path, frontier, data_cache, offline) -> None:
    """A 7-step run logging every 5 steps: its metrics' last ``tokens`` are 5 steps', the row's are all 7 steps'."""
    from tiny_models import TINY_FIT_ARGS
    from training.fit import main as fit

    assert fit(["--config", "tiny_gpt2", *TINY_FIT_ARGS, "--trainer.log_every_n_steps", "5", "--runs_dir",
                str(tmp_path), "--run_name", "r", "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled",
                "--trainer.max_steps", "7", "--trainer.val_check_interval", "7", "--model.warmup_steps", "1"]) == 0
    per_step = 8 * 64  # --data.batch_size 8 of --model.block_size 64
    step, _, logged, _ = study.last_val(tmp_path / "r" / "metrics.csv")
    tokens, seconds = study.trained(tmp_path / "r" / "last.ckpt")
    assert (step, logged) == (6, 5 * per_step)
    assert tokens == 7 * per_step and seconds > 0


def test_resume_key_includes_steps_batch_and_device(frontier) -> None:
    """A finished row is reused only for the same variant, seed, steps, batch and device (it was reused for another
    --steps); rows written before batch/device were recorded belong to the CPU study (batch 8)."""
    row = {"variant": "mha", "seed": 1, "steps": 500}
    assert study.resume_key(row) == ("mha", 1, 500, 8, "cpu")
    args = type("A", (), {"steps": 500, "batch": 8, "device": "cpu"})()
    assert study.run_key("mha", 1, args) == study.resume_key(row)
    for change in ({"steps": 2}, {"batch": 64}, {"device": "cuda"}):
        other = type("A", (), {"steps": 500, "batch": 8, "device": "cpu", **change})()
        assert study.run_key("mha", 1, other) != study.resume_key(row)


def test_compare_standard_error_and_tie(frontier) -> None:
    a = {"variant": "a", "val_loss": 3.00, "std": 0.02, "n": 3}
    b = {"variant": "b", "val_loss": 3.05, "std": 0.02, "n": 3}
    c = seed_report.compare(a, b)
    assert math.isclose(c["se"], (2 * 0.02**2 / 3) ** 0.5) and c["verdict"] == "a better"  # 3.1 SE
    assert seed_report.compare(a, {**b, "val_loss": 3.02})["verdict"] == "tie"
    assert seed_report.compare({**a, "std": 0.0, "n": 1}, {**b, "std": 0.0, "n": 1})["verdict"].startswith("no SE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.timeout(300)
def test_a_killed_study_takes_its_training_child_with_it(tmp_path: Path) -> None:
    """Killing a study (even with SIGKILL) ends the ``python -m ...`` child ``benchmarks.lib.study.run_module`` waited
    on. The child never ends by itself: the test waits on it (a pidfd opened while it runs) until it ends, bounded
    by the test's timeout only, so its end is the kill's doing whatever the machine's speed or load."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import threading, time\n"
        "import benchmarks.lib.study as f\n"
        "def report():\n"
        "    while not f._CHILDREN: time.sleep(0.05)\n"
        "    print(next(iter(f._CHILDREN)).pid, flush=True)\n"
        "threading.Thread(target=report, daemon=True).start()\n"
        "f.run_module('timeit', ['-n', '1', 'import threading; threading.Event().wait()'], 1)\n")
    path = os.pathsep.join(p for p in (str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=path))
    child = int(proc.stdout.readline())
    fd = watch(child)  # running: the driver waits on it, so it cannot have been reaped
    assert fd is not None
    proc.kill()
    proc.wait()
    wait_ended(fd)  # the training child ends with the killed study (the test's timeout fails it otherwise)


DATA = TINYSTORIES  # beside the checkout (../shared/data/tinystories)


@pytest.fixture(scope="module")
def study_cache(tmp_path_factory) -> Path:
    """The studies' data cache for this module (token shards, the BPE-4096 tokenizer): never the repository's."""
    return tmp_path_factory.mktemp("study_cache")


@pytest.mark.skipif(not DATA.is_dir(), reason="needs ../shared/data/tinystories")
def test_a_run_shorter_than_the_log_interval_reports_and_resumes(tmp_path: Path, frontier, study_cache,
                                                                 capsys) -> None:
    """``--steps 2`` crashed on ``tokens_per_s`` None in a format string, and the run was then reported failed on
    every later call. Now it reports, and a second call with ``--resume`` reuses the finished run. Its ``tokens`` are the tokens it
    trained (2 steps x batch 2 x 256), not those of the last logged step (none: it logs every 20 steps)."""
    argv = ["--steps", "2", "--batch", "2", "--variants", "mqa", "--seeds", "1", "--out", str(tmp_path / "f.json"),
            "--runs-dir", str(tmp_path / "runs"), "--cache-tokens", "16", "--data-cache", str(study_cache)]
    assert frontier.main(argv) == 0
    first = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert len(first) == 1 and first[0]["steps"] == 2 and first[0]["tokens"] == 2 * 2 * 256
    assert first[0]["tokens_per_s"] > 0  # (train_time_s is rounded to 0.1 s: no ratio of it is checked)
    assert frontier.main(argv) == 2  # the study's results exist: kept unless --resume (or --force)
    assert "f.json: exists (--force replaces it)" in capsys.readouterr().err
    assert frontier.main([*argv, "--resume"]) == 0  # nothing left to run: the row is kept, nothing fails
    assert json.loads((tmp_path / "f.json").read_text())["rows"] == first
    assert "failed" not in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_device_cuda_without_a_gpu_is_one_line_before_any_run(tmp_path: Path, frontier, capsys) -> None:
    argv = ["--device", "cuda", "--steps", "2", "--out", str(tmp_path / "f"), "--runs-dir", str(tmp_path / "runs")]
    assert frontier.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("frontier: error: --device cuda: "), err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "f.json").exists()


@pytest.mark.skipif(not DATA.is_dir(), reason="needs ../shared/data/tinystories")
def test_recipe_study_inserts_each_ratio_into_one_shared_mla_stage(tmp_path: Path, frontier, study_cache) -> None:
    """``kvsplice_recipe.py --study recipe``: ``insert`` (KVSplice-50) and ``insert90`` (KVSplice-90) of one seed
    share their MLA-128 stage (trained once), and each row holds the cache of the ratio it inserted."""
    mod = load_benchmark("kvsplice_recipe")  # imports benchmarks.lib.study, not benchmarks/frontier.py
    out, runs = tmp_path / "r.json", tmp_path / "runs"
    assert mod.main(["--study", "recipe", "--steps", "4", "--batch", "2", "--seeds", "1", "--jobs", "2",
                     "--out", str(out), "--runs-dir", str(runs), "--data", str(DATA),
                     "--data-cache", str(study_cache)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"insert", "insert90"}
    assert rows["insert"]["cache_bytes_per_token"] == 4 * 64 * 2  # 4 layers x 64 dims x fp16
    assert rows["insert90"]["cache_bytes_per_token"] == 4 * 13 * 2  # round(128 x 0.1) = 13 dims
    assert rows["insert"]["stage1_val_loss"] == rows["insert90"]["stage1_val_loss"]  # one shared MLA-128 stage
    assert sorted(p.name for p in (runs / "recipe").iterdir() if p.name.startswith("insert-s1-mla128")) == \
        ["insert-s1-mla128"]


def test_comparisons_pair_equal_bytes_layout_twins_and_the_reference_once(frontier) -> None:
    def s(v: str, b: int, loss: float) -> dict:
        return {"variant": v, "bytes": b, "val_loss": loss, "std": 0.01, "n": 3}

    summary = [s("mha", 2048, 4.15), s("ds_mha", 2048, 3.76), s("mla_128", 1024, 4.17), s("ds_mla_120", 1024, 3.85),
               s("ds_mla_128", 1088, 3.84)]
    pairs = [(c["a"], c["b"]) for c in seed_report.comparisons(summary)]
    assert len(pairs) == len({frozenset(p) for p in pairs})  # each pair once (ds_mha vs mha is all three kinds)
    assert ("ds_mha", "mha") in pairs and ("ds_mla_120", "mla_128") in pairs  # equal bytes
    assert ("ds_mla_128", "mla_128") in pairs  # the layout twin, 1088 vs 1024 bytes
    assert ("ds_mla_128", "mha") in pairs and ("mla_128", "mha") in pairs  # against the reference
