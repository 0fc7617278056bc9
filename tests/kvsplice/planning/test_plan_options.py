"""``plan``'s options declared once (:class:`kvsplice.planning.options.PlanOptions`): the library's search takes the
command's defaults, and what the model's shapes already rule out is refused before any calibration — a budget no
candidate reaches, a --tune-length beyond the model's positions, a store spec with a bad value — while the default
--seq-len fits the model (stories260K: 512 positions)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.harness.paths import CALIB, DATA, STORIES
from hostile import one_error, s260k  # noqa: F401  (s260k: a fixture)
from kvsplice.cli import plan as plan_cli
from kvsplice.planning.options import PlanOptions
from kvsplice.planning.search import SearchOptions

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file() or not CALIB.is_file(),
                                reason=f"stories260K / TinyStories not found under {DATA}")
SMALL = ["--calib", str(CALIB), "--calib-tokens", "2048", "--tune-tokens", "512", "--no-progress"]


class _Calibrated(Exception):
    """Raised where the planner would calibrate: everything before it passed."""


@pytest.fixture
def no_calibration(monkeypatch):
    import kvsplice.lowrank.sensitivity as sens

    def reached(model, batches, **kw):
        raise _Calibrated(kw["source"])

    monkeypatch.setattr(sens, "stats_for", reached)


def test_the_search_defaults_are_the_commands():
    """One set of defaults: SearchOptions (the library) and PlanOptions / ``plan``'s parser (the command)."""
    search = SearchOptions(prompt_len=8, budget=1.0)
    command = plan_cli.build_parser().parse_args(["--model", "m", "--calib", "c", "--ratio", "2", "--out", "o"])
    plan = PlanOptions(model="m", calib="c", ratio=2, out="o")
    for s_name, p_name in (("selectors", "selectors"), ("batch_size", "batch_size"), ("objective", "objective"),
                           ("task_tolerance", "task_tolerance"), ("fit_len", "fit_length"), ("prefill", "prefill")):
        assert getattr(search, s_name) == getattr(plan, p_name), s_name
        got = getattr(command, p_name)
        assert (tuple(got) if isinstance(got, list) else got) == getattr(plan, p_name), p_name
    assert (search.objective, search.batch_size) == ("mixed", 2)


def test_the_library_options_refuse_what_the_command_refuses():
    for kw, needle in (({"ratio": 0.5}, "--ratio must be > 1"), ({"ratio": 1e9}, "--ratio must be > 1"),
                       ({"budget_bytes_per_token": float("nan")}, "--budget-bytes-per-token"),
                       ({}, "give one of"), ({"ratio": 2, "seq_len": 0}, "--seq-len")):
        with pytest.raises(ValueError, match=needle):
            PlanOptions(model="m", calib="c", out="o", **kw)


@pytest.mark.parametrize("argv, needle", [
    (["--ratio", "1e9"], "argument --ratio: must be > 1, finite and at most"),
    (["--ratio", "5000"], "--ratio 5000: no stack fits"),
    (["--budget-bytes-per-token", "0.01"], "--budget-bytes-per-token 0.01: no stack fits"),
    (["--budget-bytes-per-token", "1e9"], "at least the fp16 full cache's 640 bytes"),
    (["--ratio", "3", "--tune-length", "100000"], "--tune-length 100000 exceeds the model's 512 positions"),
    (["--ratio", "3", "--stores", "kivi(bits=99)"], "argument --stores: kivi(bits=99): bits must be one of"),
])
def test_plan_refuses_before_calibrating(s260k, tmp_path, capsys, monkeypatch, no_calibration, argv, needle):
    import kvsplice.loading as loading

    monkeypatch.setattr(loading, "token_stream", lambda *a, **k: pytest.fail("read the text before refusing"))
    rc = plan_cli.main(["--model", str(s260k), *SMALL, "--seq-len", "256", *argv, "--out", str(tmp_path / "p.json")])
    one_error(rc, capsys.readouterr().err, "plan", needle)
    assert not list(tmp_path.iterdir())


def test_the_default_seq_len_fits_the_models_positions(s260k, tmp_path, no_calibration):
    """No --seq-len on a 512-position model: windows of 512 (was 1024: refused), tuning prompts within reach."""
    with pytest.raises(_Calibrated) as e:
        plan_cli.main(["--model", str(s260k), *SMALL, "--ratio", "3", "--tune-n", "1",
                       "--out", str(tmp_path / "p.json")])
    assert e.value.args[0]["seq_len"] == 512
    opts = dataclasses.replace(PlanOptions(model="m", calib="c", ratio=2, out="o"))
    assert (opts.window(512), opts.window(4096), opts.window(None), opts.window_prompt(512)) == (512, 1024, 512, 384)
