"""Our DeepSeek-V3 exports in vLLM (CPU) through the package's plugin, in one KV budget: exactness against
transformers, vLLM's cache tokens against the bytes-per-token formula, decode tokens/s at each model's largest batch;
the padded 512 + 64 route (vLLM without the plugin) beside it. Needs vLLM's venv (docs/vllm.md).

    python -m benchmarks.engines_vllm_plugin --context 1024 --new 16 --shapes ds_mha ds_mla_kvsplice_90 --repeats 3
    python -m benchmarks.engines_vllm_plugin --skip-124m --context 128 --trained RUNS/tiny_ds_mha/last.ckpt ...
    python -m benchmarks.engines_vllm_plugin --join A.json B.json --out results/engines_vllm_plugin

Models: the 124M shapes (random weights, seed 0) and ``--trained`` tiny checkpoints, a group's budget ``--mha-seqs``
sequences of its standard attention; ``--repeats``: each ratio's spread, the table the run nearest the median.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.harness import report
from benchmarks.harness.options import UsageError
from benchmarks.harness.runner import Study
from benchmarks.lib import engines as lib


def options(ap) -> None:
    ap.add_argument("--trained", type=Path, nargs="*", default=[], help="trained deepseek_v3-layout checkpoints")
    ap.add_argument("--context", type=int, help="tokens per sequence")
    ap.add_argument("--new", type=int, help="greedy / decoded tokens")
    ap.add_argument("--mha-seqs", dest="mha_seqs", type=int, help="the budget: this many standard-attention sequences")
    ap.add_argument("--shapes", nargs="*", choices=lib.SHAPES, help="the 124M shapes")
    ap.add_argument("--skip-124m", action="store_true", help="no 124M shapes (as --shapes with none)")
    ap.add_argument("--repeats", type=int, help=f"run everything this many times (1-{lib.MAX_REPEATS})")
    ap.add_argument("--join", type=Path, nargs="+", help="join runs' JSON files into --out (no vLLM run)")


def joined(paths: list[Path]):
    """The rows of earlier results files, each a ``part`` (a file from before the runner: its ``runs``)."""
    for j, path in enumerate(paths):
        data = json.loads(path.read_text(encoding="utf-8"))
        if "study" in data:
            yield from (dict(r, part=j) for r in data["rows"])
            continue
        for i, u in enumerate(data.get("runs") or [dict(rows=data["rows"], load=None)]):
            for r in u["rows"]:
                yield dict(r, part=j, run=i, load=u["load"], vllm=data.get("vllm"),
                           kv_budget=r.get("kv_budget", data.get("budget")))


def rows(run):
    """Every model ``--repeats`` times (each row: its ``run`` and that run's ``load``), or the ``--join``ed rows."""
    from kvsplice.convert.engines import vllm as vllm_engine

    a = run.args
    why = next((f"--join {p}: no such file" for p in a.join or [] if not p.is_file()), None)
    if a.join and not why:
        yield from joined(a.join)
        return
    why = why or vllm_engine.missing() or next((f"--trained {p}: no such file" for p in a.trained
                                               if not p.is_file()), None)
    if why:
        raise UsageError(why)
    for i in range(run["repeats"]):
        done = []
        with lib.sampled_load() as load:
            for row in lib.one_run([] if a.skip_124m else run["shapes"], a.trained, mha_seqs=run["mha_seqs"],
                                   context=run["context"], new=run["new"],
                                   previous=lambda **key: run.previous(run=i, part=0, **key)):
                done.append(dict(row, run=i, part=0))
                yield done[-1]
        for r in done:  # the conditions of the whole run, in each of its rows
            r["load"] = dict(load)
        run.say(f"engines_vllm_plugin: run {i + 1} of {run['repeats']} done; load {load}")


def summary(run, rows) -> dict:
    """Per part (a joined file): the repeats' spread and the run nearest the median (the table's rows); the ratios."""
    table, repeats, parts = [], [], {}
    for r in rows:
        parts.setdefault(r.get("part", 0), {}).setdefault(r.get("run", 0), []).append(r)
    for runs in parts.values():
        done = [dict(rows=x, load=x[0].get("load")) for x in runs.values()]
        rep = lib.repeat_summary(done) if len(done) > 1 else []
        table += lib.median_run(done, rep)["rows"]
        repeats += rep
    res = {"vllm": next((r["vllm"] for r in rows if r.get("vllm")), "?"), "ratios": lib.ratios(table),
           "repeats": repeats, "table": [rows.index(r) for r in table]}
    budgets = {("124M shapes" if "124M" in r["model"] else "tiny"): r.get("kv_budget") for r in table}
    run.notes.update(vllm=res["vllm"], slack=lib.SLACK, report=report_rows(table, res),
                     budgets="; ".join(f"{g} {b:,} B" for g, b in budgets.items() if b))
    return res


def report_rows(table: list[dict], res: dict) -> list[dict]:
    """The report's rows (``section``: runs, ratios, repeats) with the cells a template cannot compute."""
    out = []
    for r in table:
        t = r.get("throughput") or {}
        out.append(dict(r, section="runs", route="plugin" if r["plugin"] else "padded 512+64, vLLM alone",
                        tokens=t.get("prompt", 0) + t.get("new", 0),
                        same="=" if r.get("bytes_per_token") == r["bytes_per_token_formula"] else "≠"))
    out += [dict(section="ratios", ratio=k, value=v) for k, v in res["ratios"].items()]
    for r in res["repeats"]:
        each = zip(r["median_step"]["values"], r["all_steps"]["values"])
        out.append(dict(r, section="repeats", each=", ".join(f"{x:.2f} / {y:.2f}" for x, y in each),
                        loads=", ".join(f"{x['mean']:.1f} ({x['max']:.1f})" if x else "—" for x in r["load"])))
    return out


STUDY = Study("engines_vllm_plugin", __doc__, rows, options=options, summary=summary, threads=None,
              markdown=lambda run, rows: report.markdown(STUDY.spec("report"), run.notes["report"], run.notes),
              bounds={"context": (32, 1 << 17), "new": (1, 4096), "mha_seqs": (1, 1 << 20),
                      "repeats": (1, lib.MAX_REPEATS)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
