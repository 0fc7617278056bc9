"""The thread count of a CPU training run follows the cores other processes leave free (``training.threads``).

The CPU readings are made up (a ``/proc/stat`` text, :class:`CpuSample` values), so nothing here depends on the
load of the machine the tests run on.
"""

from __future__ import annotations

import os

import lightning.pytorch  # noqa: F401  (Lightning's log handler binds to the session's stderr, not one test's capture)
import pytest
import torch

import training.lightning_cli
import training.threads as threads
from tiny_models import TINY_FIT_ARGS
from training.threads import CpuSample, cpu_sample, free_cores, pick_threads

CORES = sorted(os.sched_getaffinity(0))


def test_cpu_sample_counts_busy_time_of_this_process_cores(tmp_path):
    """user + nice + system + irq + softirq + steal of the cores in the affinity set, in seconds; idle and iowait
    are free; cores outside the set (cpu999) are ignored."""
    tick = os.sysconf("SC_CLK_TCK")
    lines = ["cpu  1 1 1 1 1 1 1 1 0 0"]
    lines += [f"cpu{c} 100 20 30 5000 40 1 2 3 0 0" for c in CORES]
    lines += ["cpu999 100000 0 0 0 0 0 0 0 0 0", "intr 12345", "ctxt 42"]
    stat = tmp_path / "stat"
    stat.write_text("\n".join(lines) + "\n")
    s = cpu_sample(stat)
    assert s.cores == len(CORES) and s.busy == pytest.approx(len(CORES) * 156 / tick)
    assert s.own > 0 and cpu_sample(tmp_path / "missing") is None


@pytest.mark.parametrize("others, own, expect", [
    (0.0, 1.0, 2.0),   # idle machine, this process busy on one core: both cores are free for it
    (1.0, 0.5, 1.0),   # one CPU-bound process
    (2.5, 0.0, 0.0),   # more than the machine: none free (not negative)
])
def test_free_cores_discounts_this_process_own_time(others, own, expect):
    start = CpuSample(wall=10.0, busy=100.0, own=3.0, cores=2)
    end = CpuSample(wall=12.0, busy=100.0 + 2.0 * (others + own), own=3.0 + 2.0 * own, cores=2)
    assert free_cores(start, end) == pytest.approx(expect)


@pytest.mark.parametrize("free, default, expect", [(2.0, 2, 2), (1.8, 2, 2), (1.0, 2, 1), (1.6, 2, 1),
                                                  (0.0, 2, 1), (7.9, 16, 8), (16.0, 16, 16), (4.0, 1, 1)])
def test_pick_threads_caps_torch_default_by_the_free_cores(free, default, expect, monkeypatch):
    start = CpuSample(wall=0.0, busy=0.0, own=0.0, cores=default)  # wall 0: the window is long over, no waiting
    end = CpuSample(wall=10.0, busy=10.0 * (default - free), own=0.0, cores=default)
    monkeypatch.setattr(threads, "cpu_sample", lambda: end)
    picked, note = pick_threads(start, default)
    assert picked == expect and (note is None) == (expect == default)
    if note:
        assert note.startswith(f"torch threads: {expect} of {default}") and "--torch_threads N" in note
    assert pick_threads(None, default) == (default, None)  # no /proc/stat: torch's own count


@pytest.fixture
def two_torch_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("extra, expect, noted", [([], 1, True), (["--torch_threads", "2"], 2, False)])
def test_training_beside_a_busy_core_uses_one_thread_unless_told(extra, expect, noted, tmp_path, data_cache,
                                                                 monkeypatch, capsys, two_torch_threads):
    """The start-up readings say another process held one of two cores: the run trains on one thread, says so in
    one note; ``--torch_threads 2`` keeps two."""
    from training.fit import main
    from training.lit import LitGPT

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    start = CpuSample(wall=0.0, busy=50.0, own=1.0, cores=2)
    end = CpuSample(wall=10.0, busy=50.0 + 10.0 + 3.0, own=4.0, cores=2)  # others: 10 CPU s in 10 s = one core
    monkeypatch.setattr(training.lightning_cli, "cpu_sample", lambda: start)
    monkeypatch.setattr(threads, "cpu_sample", lambda: end)
    seen = []
    monkeypatch.setattr(LitGPT, "on_train_start", lambda self: seen.append(torch.get_num_threads()))
    rc = main(["--config", "tiny_gpt2", *TINY_FIT_ARGS, "--trainer.max_steps", "1", "--runs_dir", str(tmp_path),
               "--data.cache_dir", str(data_cache), "--wandb.mode", "disabled", *extra])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert seen == [expect]
    assert ("note: torch threads: 1 of 2 (other processes keep 1.0 of the 2 cores busy" in err) is noted, err
