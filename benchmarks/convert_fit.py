"""SmolLM2-135M → MLA with ``kvsplice to-mla --ratio N`` (training-free, with and without the layer-local
correction, then fine-tuned by ``kvsplice distill --minutes M``): what the converted model keeps of its source.
``python -m benchmarks.convert_fit [--size smoke] [--work DIR] [--ratios 2 4] [--keep F] [--minutes 60]``.

Per ratio and ``--refine`` value: ``kvsplice to-mla --model SRC --calib TEXT... --ratio N --refine-steps K`` (``--keep
F``: KVSplice keeping F of the latent), then a row of :mod:`benchmarks.lib.model_quality`; the source is the first
row. With ``--minutes M`` > 0 each conversion at the last ``--refine`` value is fine-tuned (``kvsplice distill``) and
each snapshot and the final model is a row. ``--work``'s folders are reused; ``--size smoke``: stories260K.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.harness.paths import CALIB, EVAL, SMOLLM2, portable
from benchmarks.harness.runner import Study
from benchmarks.lib.stories import convert_stories
from benchmarks.lib.study import run_module


def options(p) -> None:
    p.add_argument("--work", default=None, help="folder of converted models (reused; default: a temporary folder)")
    p.add_argument("--ratios", type=float, nargs="+", default=None, help="cache ratios (default: the size's)")
    p.add_argument("--refine", type=int, nargs="+", default=None, help="--refine-steps values (default: the size's)")
    p.add_argument("--keep", type=float, default=None, help="insert KVSplice keeping this fraction of the latent")
    p.add_argument("--minutes", type=float, default=None, help="distill minutes per conversion (0: none)")
    p.add_argument("--snapshots", type=float, nargs="+", default=None, help="distill snapshot minutes")
    p.add_argument("--self-tokens", type=int, default=None, help="distill --self-tokens")
    p.add_argument("--calib", nargs="+", default=None, help="to-mla --calib (default: the TinyStories train sample)")


def _kvsplice(run, cmd: list[str], done: Path) -> str:
    """Run ``kvsplice ...`` unless ``done`` exists (``--work``'s folders are reused); the command, ``WORK`` named."""
    if not done.exists():
        run.say(" ".join(cmd))
        run_module("kvsplice.cli.main", cmd[1:], run.args.threads)
    return portable(" ".join(cmd)).replace(run.notes["work"], "WORK")


def _convert(run, src: str, folder: Path, ratio: float, refine: int, keep) -> str:
    cmd = ["kvsplice", "to-mla", "--model", src, "--calib", *(run.args.calib or [str(CALIB)]), "--calib-tokens",
           str(run["calib_tokens"]), "--seq-len", str(run["seq_len"]), "--ratio", f"{ratio:g}", "--refine-steps",
           str(refine), *(["--kvsplice-keep", f"{keep:g}"] if keep else []), "--out", str(folder), "--json",
           str(folder) + ".json", "--no-progress", "--threads", str(run.args.threads)]
    return _kvsplice(run, cmd, folder / "config.json")


def _distill(run, src: str, folder: Path, minutes: float) -> tuple[str, Path]:
    """The command fine-tuning ``folder`` for the study's minutes and the model folder of its ``minutes`` mark (run
    now when the run folder is absent; a run folder without that mark is a run in progress or stopped: say so)."""
    runs, name = folder.parent / "runs", "d-" + folder.name
    cmd = ["kvsplice", "distill", "--model", str(folder), "--teacher", src, "--minutes", f"{run['minutes']:g}",
           "--snapshot-minutes", *(f"{m:g}" for m in run["snapshots"]), "--self-tokens", str(run["self_tokens"]),
           "--trainable", "attention", "--runs-dir", str(runs), "--run-name", name, "--no-progress",
           "--threads", str(run.args.threads)]
    out = runs / name / ("model" if minutes == run["minutes"] else f"model-{minutes:g}min")
    if (runs / name).exists() and not (out / "config.json").is_file():
        raise SystemExit(f"convert_fit: {runs / name} has no {out.name}/ yet: a run in progress, or a stopped one "
                         f"(resume it: {' '.join(cmd)} --ckpt-path last)")
    return _kvsplice(run, cmd, out / "config.json"), out


def rows(run):
    from kvsplice.loading import iter_texts, load_model
    from benchmarks.lib.model_quality import PROSE, logits, quality, windows

    work = Path(run.args.work) if run.args.work else Path(tempfile.mkdtemp(prefix="convert_fit-"))
    work.mkdir(parents=True, exist_ok=True)
    run.notes["work"], run.header["command"] = str(work), run.header["command"].replace(str(work), "WORK")
    src = str(convert_stories(work / "src") if run.size == "smoke" else SMOLLM2)
    loaded = load_model(src)
    tok, seq = loaded.tokenizer, run["seq_len"] // 2
    p_wins = windows(tok, iter_texts(str(EVAL)), run["p_windows"], seq)
    d_wins = windows(tok, iter("\n\n\n".join(p.read_text(encoding="utf-8") for p in PROSE).split("\n\n\n")),
                     run["docs_windows"], seq // 2)
    ref = [logits(loaded.model, p_wins[i:i + 1])[0] for i in range(len(p_wins))]
    lengths, n = run["task_lengths"], run["task_n"]
    if not (prev := run.previous(model="source")):
        prev = {"model": "source", "ratio": 1.0, "refine_steps": 0, "cache_dim": None, "command": "",
                **quality(loaded.model, tok, p_wins, d_wins, None, lengths, n)}
    yield prev
    base, keep = prev, run["keep"]
    del loaded

    def measured(name: str, folder: Path, **fields) -> dict:
        model = load_model(str(folder)).model
        cfg, q = model.cfg, quality(model, tok, p_wins, d_wins, ref, lengths, n)
        row = {"model": name, **fields, "cache_dim": cfg.cache_dim, "d_latent": cfg.d_latent,
               "rope_dims": cfg.rope_dims, **q, "d_ppl_P_pct": 100 * (q["ppl_P"] / base["ppl_P"] - 1),
               "d_ppl_prose_pct": 100 * (q["ppl_prose"] / base["ppl_prose"] - 1)}
        run.say(f"{name}: {row}")
        return row

    for ratio in run["ratios"]:
        for refine in run["refine"]:
            name = f"r{ratio:g}x" + (f"-keep{keep:g}" if keep else "") + f"-refine{refine}"
            fields = {"ratio": ratio, "refine_steps": refine, "keep": keep, "minutes": 0.0}
            if not (row := run.previous(model=name)):
                cmd = _convert(run, src, work / name, ratio, refine, keep)
                row = measured(name, work / name, command=cmd, **fields)
            yield row
            if not run["minutes"] or refine != run["refine"][-1]:
                continue
            for minutes in [*(m for m in run["snapshots"] if m < run["minutes"]), run["minutes"]]:
                tuned = f"{name}+distill{minutes:g}min"
                if not (row := run.previous(model=tuned)):
                    cmd, out = _distill(run, src, work / name, minutes)
                    row = measured(tuned, out, command=cmd, **{**fields, "minutes": minutes})
                yield row


def summary(run, rows) -> dict:
    """Each row's cache (``R + Dr``; the source's: K/V) and the commands that made the models, for the report."""
    for r in rows:
        r["cache"] = "K/V" if r["cache_dim"] is None else f"{r['d_latent']} + {r['rope_dims']}"
    return {"commands": "\n".join(dict.fromkeys(f"- `{r['command']}`" for r in rows if r["command"]))}


STUDY = Study("convert_fit", __doc__, rows, options=options, summary=summary, threads=2,
              bounds={"ratios": (1.01, 64), "refine": (0, 10000), "minutes": (0, 10000), "snapshots": (0.01, 10000),
                      "self_tokens": (1024, 1 << 24), "calib_tokens": (64, 1 << 22), "seq_len": (16, 1 << 15),
                      "task_lengths": (64, 1 << 15), "task_n": (1, 1000), "p_windows": (1, 1000),
                      "docs_windows": (1, 1000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
