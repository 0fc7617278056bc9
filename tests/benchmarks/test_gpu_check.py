"""benchmarks/gpu_check.py on CPU: the dry-run plan fits 8 minutes and touches no torch, the budget / skip logic, the
report from its rows, a failed section, the pytest plugin's log, a stopped process group, and a smoke run of the
real orchestration (a study's command per section, on the runner) with jsonargparse / wandb / datasets made
unimportable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from benchmarks.harness import sections
from benchmarks.harness.sections import cuda_test_split, read_testlog
from processes import wait_ended, watch
from tiny_models import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.gpu_check"]  # run from the repository (cwd=ROOT)
BLOCKER = """\
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("blocked by the test: " + name)
sys.meta_path.insert(0, _Block())
"""


@pytest.fixture(scope="module")
def gc():
    return load_benchmark("gpu_check")


def _blocking_env(tmp_path: Path, blocked=("jsonargparse", "wandb", "datasets")) -> dict:
    """An environment whose python processes (children included) cannot import ``blocked``."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(blocked)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def test_dry_run_plans_every_section_within_8_minutes_without_torch(tmp_path):
    """``--dry-run`` lists the seven sections in order with their estimates, and the total is <= 480 s; it runs with
    torch made unimportable (so it cannot touch CUDA)."""
    env = _blocking_env(tmp_path, blocked=("torch", "triton"))
    res = subprocess.run([sys.executable, *SCRIPT, "--dry-run"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    names = re.findall(r"^\s+\d\. (\w+)\s+~(\d+) s", out, flags=re.M)
    assert [n for n, _ in names] == ["tests", "kernel", "decode", "capacity", "profile", "train", "flash4"]
    total = int(re.search(r"estimate (\d+) s", out).group(1))
    assert total <= 480 and total == 10 + sum(int(s) for _, s in names)
    assert "SKIPPED" not in out and "<= budget 480 s: yes" in out


def test_dry_run_marks_what_a_small_budget_skips():
    res = subprocess.run([sys.executable, *SCRIPT, "--dry-run", "--budget-s", "150", "--sections", "flash4",
                          "train", "kernel"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if re.match(r"\s+\d\.", ln)]
    assert [ln.split()[1] for ln in lines] == ["kernel", "train", "flash4"]  # the fixed order
    assert "SKIPPED" in lines[1] and "SKIPPED" not in lines[0] + lines[2]


@pytest.mark.parametrize("argv, msg", [(["--budget-s", "0"], "--budget-s"), (["--sections", "gpu"], "--sections"),
                                       (["--budget-s", "nan"], "--budget-s"), (["--no-such"], "--no-such"),
                                       (["--out-dir", __file__], "--out-dir")])
def test_bad_options_are_one_line_and_exit_2(gc, argv, msg, capsys):
    assert gc.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_check: error:") and msg in err[0]


def test_budget_logic(gc):
    assert sections.decide(50, 80, 400) == (True, 80, None)
    assert sections.decide(50, 80, 60) == (True, 60, None)  # stopped at the end of the budget, before its own limit
    run, _, reason = sections.decide(50, 80, 49)
    assert not run and "49 s" in reason and "50 s" in reason
    steps = sections.plan(gc.SETTINGS, list(gc.SECTIONS), 480, smoke=False)
    assert all(p["runs"] for p in steps)
    assert gc.STARTUP_S + sum(p["estimate_s"] for p in steps) <= 480
    assert all(p["limit_s"] >= p["estimate_s"] for p in steps)
    small = sections.plan(gc.SETTINGS, list(gc.SECTIONS), 200, smoke=False)  # 190 s after the start: tests (120), kernel (45), flash4
    assert [p["section"] for p in small if p["runs"]] == ["tests", "kernel", "flash4"]
    assert all(p["skip_reason"] for p in small if not p["runs"])


@pytest.mark.parametrize("name, tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H100 NVL", "h100"),
                                       ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090"), ("Tesla T4", "tesla_t4"),
                                       ("../x/ y", "x_y")])
def test_device_tag_is_file_name_safe(gc, name, tag):
    assert gc.device_tag(name) == tag


def test_the_report_comes_from_the_rows_the_last_status_counting(gc):
    """A section's state is its last status row; its table shows its columns (passed tests: the JSON only), a
    non-finite number as ``-``, ``|`` escaped; the summary is one line."""
    rows = [dict(section="tests", status="pending", estimate_s=120), dict(section="kernel", status="pending"),
            dict(section="flash4", status="pending"), dict(section="tests", status="running", what="pytest -m gpu"),
            dict(section="tests", test="t::a", outcome="passed", seconds=1.0),
            dict(section="tests", test="t::b", outcome="failed", seconds=2.0, message="E  assert 1 == 2 | x"),
            dict(section="tests", status="failed", reason="failed: t::b", summary=dict(passed=1, failed=1),
                 elapsed_s=30.0, estimate_s=120, what="pytest -m gpu"),
            dict(section="kernel", status="running"),
            dict(section="kernel", case="latent 26", sdpa_ms=0.3, split_kv_ms=0.05, max_abs_diff=float("nan"))]
    state = sections.by_section(rows, list(gc.SECTIONS))
    assert list(state) == ["tests", "kernel", "flash4"] and [s["status"] for s in state.values()] == [
        "failed", "running", "pending"]
    assert [r["test"] for r in state["tests"]["rows"]] == ["t::a", "t::b"] and len(state["kernel"]["rows"]) == 1
    md = gc.markdown(_Run(dict(device="X", torch="2.13", decode_kernel_default="auto", started="now",
                               elapsed_s=31.0, cuda="13.0", capability=[9, 0], triton=None)), rows)
    assert md.startswith("# GPU check — X") and "| latent 26 | 0.300 | 0.050 | - |" in md
    assert "| tests | **failed** | 30 | 120 | failed: t::b | passed: 1; failed: 1 |" in md
    assert "| kernel | **running** |" in md and "| flash4 | **pending** |" in md
    assert "t::b" in md and "t::a" not in md and "assert 1 == 2 \\| x" in md
    assert "CUDA 13.0, compute capability 9.0." in md and "triton" not in md and "took 31 s" in md


class _Run(dict):
    """What :func:`gpu_check.markdown` reads of a run: its notes, size and settings."""

    def __init__(self, notes: dict) -> None:
        super().__init__(budget_s=480.0)
        self.notes, self.size, self.settings = notes, "default", dict(self)


def test_a_failed_section_is_an_error_and_one_past_the_budget_skipped(tmp_path):
    """A section whose process fails (here the training study on a machine without CUDA: exit 2) is an ``error``
    with the process's last line, and the next section still runs; a section whose estimate no longer fits is
    ``skipped`` with the budget's reason, without a process."""
    spec = dict(study="gpu", what="the training step")
    step = dict(section="train", estimate_s=10, limit_s=60)
    rows = list(sections.run_section("t", step, spec, 100, True, False, tmp_path))
    assert [r["status"] for r in rows] == ["running", "error"]
    assert "exit code 2" in rows[-1]["reason"] and "no CUDA device" in rows[-1]["reason"]
    skipped = list(sections.run_section("t", dict(step, estimate_s=200), spec, 100, True, False, tmp_path))
    assert len(skipped) == 1 and skipped[0]["status"] == "skipped" and skipped[0]["reason"].startswith("budget:")
    cuda_only = list(sections.run_section("t", step, dict(spec, cuda=True), 100, True, False, tmp_path))
    assert [r["status"] for r in cuda_only] == ["skipped"] and "CUDA" in cuda_only[0]["reason"]


def test_testlog_counts_and_names_the_test_that_hung(tmp_path):
    log = tmp_path / "t.jsonl"
    entries = [dict(event="start", test="a"), dict(event="end", test="a", outcome="passed", seconds=1.0, message=""),
               dict(event="start", test="b"), dict(event="end", test="b", outcome="failed", seconds=0.5, message="E"),
               dict(event="start", test="c"), dict(event="end", test="c", outcome="skipped", seconds=0, message="r"),
               dict(event="start", test="d")]
    log.write_text("\n".join(json.dumps(e) for e in entries) + '\n{"event": "end", "te')  # a line cut off
    rows, counts, hung = read_testlog(log)
    assert counts == dict(passed=1, failed=1, error=0, skipped=1) and hung == "d"
    assert [r["test"] for r in rows] == ["a", "b", "c"]
    assert read_testlog(tmp_path / "none.jsonl") == ([], dict(passed=0, failed=0, error=0, skipped=0), None)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on a pidfd (Linux)")
@pytest.mark.timeout(300)
def test_a_process_past_its_limit_is_stopped_with_its_children(tmp_path, monkeypatch):
    """A section that never ends by itself (it and its child wait forever) is stopped at its limit, its child with
    it. The limit counts from the moment the section says it is up (its child's pid in a file), whatever the
    machine's speed or load."""
    pid_file = tmp_path / "pid"
    code = ("import pathlib, subprocess, sys, threading; p = subprocess.Popen([sys.executable, '-c', 'import "
            "threading; threading.Event().wait()']); print('started', flush=True); "
            f"t = pathlib.Path({str(pid_file)!r} + '.tmp'); t.write_text(str(p.pid)); t.rename({str(pid_file)!r}); "
            "threading.Event().wait()")
    watched: list = []

    class Up(subprocess.Popen):
        def wait(self, timeout=None):
            while not pid_file.exists() and self.poll() is None:  # bounded by the process: it ends or says so
                threading.Event().wait(0.01)
            if pid_file.exists() and not watched:
                watched.append(watch(int(pid_file.read_text())))  # the child, watched while it surely lives
            return super().wait(timeout)

    monkeypatch.setattr(sections.subprocess, "Popen", Up)
    rc, tail = sections.run_process([sys.executable, "-c", code], 3, dict(os.environ))
    assert rc is None and "started" in tail  # it cannot end by itself: None is the stop at its limit
    assert watched and watched[0] is not None
    wait_ended(watched[0])  # the child ended too (the test's timeout fails it otherwise)
    monkeypatch.undo()
    assert sections.run_process([sys.executable, "-c", "print('hi')"], 30, dict(os.environ)) == (0, "hi")


def test_smoke_run_writes_every_section_in_processes_without_jsonargparse_wandb_datasets(tmp_path):
    """The real orchestration at tiny sizes on CPU: the tests section (pytest + the plugin), the decode section in
    its own process (rows, ratios), train skipped on CPU, flash4's reason; all with jsonargparse / wandb / datasets
    unimportable, in the parent, pytest and every child."""
    env = _blocking_env(tmp_path)
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, *SCRIPT, "--smoke", "--sections", "tests", "decode", "train", "flash4",
                          "--out-dir", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu_check_cpu_smoke.json").read_text())
    sec = sections.by_section(report["rows"], list(report["settings"]["sections"]))
    assert list(sec) == ["tests", "decode", "train", "flash4"] and report["complete"]
    assert sec["tests"]["status"] == "ok" and sec["tests"]["rows"]  # test_graph_decode's gpu tests: skipped here
    assert all(r["outcome"] == "skipped" for r in sec["tests"]["rows"])
    assert sec["decode"]["status"] == "ok"
    rows = {(r["variant"], r["path"]): r for r in sec["decode"]["rows"]}
    assert ("MHA", "sdpa") in rows and ("KVSplice-90", "sdpa") in rows
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows.values())
    assert rows[("MHA", "sdpa")]["vs_mha_sdpa"] == 1
    assert sec["train"]["status"] == "skipped" and "CUDA" in sec["train"]["reason"]
    assert sec["flash4"]["status"] in ("skipped", "ok")
    assert all(s["elapsed_s"] is not None for s in sec.values() if s["status"] != "skipped")
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check_cpu_smoke.json", "gpu_check_cpu_smoke.md"]
    md = (out / "gpu_check_cpu_smoke.md").read_text()
    assert "Smoke run" in md and "| decode | **ok** |" in md and "## decode" in md and "| flash4 | **" in md


def test_resume_keeps_the_sections_this_run_does_not_redo(gc, tmp_path, capsys):
    """A second call finishes a cut-off first one: ``--resume`` keeps the earlier sections of the same device."""
    out = tmp_path / "o"
    assert gc.main(["--smoke", "--sections", "flash4", "--out-dir", str(out)]) == 0
    path = out / "gpu_check_cpu_smoke.json"
    first = sections.by_section(json.loads(path.read_text())["rows"], list(gc.SECTIONS))["flash4"]
    assert gc.main(["--smoke", "--sections", "train", "--out-dir", str(out), "--resume"]) == 0
    data = json.loads(path.read_text())
    state = sections.by_section(data["rows"], list(gc.SECTIONS))
    assert list(state) == ["train", "flash4"] and state["flash4"] == first
    from models.kernels import DEFAULT_DECODE_KERNEL

    assert data["decode_kernel_default"] == DEFAULT_DECODE_KERNEL
    assert "train skipped" in capsys.readouterr().err


HOLD = """\
import importlib.abc, os, pathlib, sys, threading
class _Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "benchmarks.lib.serving_bench" and "--sections" in sys.argv:  # a section's process, its work:
            tmp = pathlib.Path({handshake!r} + ".tmp")              # say so (its pid), then wait there
            tmp.write_text(str(os.getpid()))
            tmp.rename({handshake!r})
            threading.Event().wait()
        return None
sys.meta_path.insert(0, _Hold())
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on a pidfd (Linux)")
@pytest.mark.timeout(600)
def test_sigterm_stops_the_running_section_and_records_it(tmp_path):
    """The device tool's timeout (SIGTERM to the command): the running section's processes end, the section is
    recorded as ``stopped``, the rows and sections before it stay. The section's process holds at the start of its
    work (an import hook of the test's says so in a handshake file and waits there), so the signal lands while the
    section runs whatever the machine's speed or load."""
    handshake, out = tmp_path / "held", tmp_path / "o"
    path = out / "gpu_check_cpu_smoke.json"
    env = _blocking_env(tmp_path)  # (jsonargparse, wandb, datasets unimportable: as on the device)
    with open(tmp_path / "site" / "sitecustomize.py", "a") as f:
        f.write(HOLD.format(handshake=str(handshake)))
    proc = subprocess.Popen([sys.executable, *SCRIPT, "--smoke", "--sections", "decode", "flash4", "--out-dir",
                             str(out)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not handshake.exists() and proc.poll() is None:  # bounded by the process: it holds there or ends
        threading.Event().wait(0.01)
    assert proc.poll() is None, f"the decode section never started (exit {proc.returncode})"
    held = watch(int(handshake.read_text()))
    assert sections.by_section(json.loads(path.read_text())["rows"], ["decode"])["decode"]["status"] == "running"
    proc.terminate()
    assert proc.wait() == 128 + 15
    wait_ended(held)  # the section's process ended with the run
    sec = sections.by_section(json.loads(path.read_text())["rows"], ["decode", "flash4"])
    assert sec["decode"]["status"] == "stopped" and "Terminated" in sec["decode"]["reason"]
    assert sec["flash4"]["status"] == "pending"  # not reached


def test_the_gpu_tests_and_benchmarks_import_without_what_the_device_lacks(gc, tmp_path):
    """The device has torch, triton, transformers, pytest, ... but not jsonargparse, wandb, datasets (nor gguf,
    accelerate): the tests section's files are collected and the benchmarks the sections reuse are imported
    without them."""
    env = _blocking_env(tmp_path, blocked=("jsonargparse", "wandb", "datasets", "gguf", "accelerate"))
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *gc.TEST_FILES], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    code = "import benchmarks.gpu_check, benchmarks.gpu, benchmarks.serving, benchmarks.harness.timing"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_cuda_test_split_is_what_the_tests_section_runs(gc):
    """The files with CUDA tests are exactly the tests section's; every other test file is listed as left unrun."""
    cuda, rest = cuda_test_split()
    assert cuda == sorted(gc.TEST_FILES) and rest and not set(cuda) & set(rest)
    assert "tests/benchmarks/test_gpu_check.py" in rest


def test_an_earlier_report_is_kept_without_force(gc, tmp_path, capsys):
    """Issue 60's footing: an earlier report of this device is not replaced without ``--force`` (or ``--merge``):
    one line, exit 2, the file as it was."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "gpu_check_cpu_smoke.json").write_text("earlier")
    assert gc.main(["--smoke", "--sections", "flash4", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists (--force replaces it)" in err[0], err
    assert (out / "gpu_check_cpu_smoke.json").read_text() == "earlier"
