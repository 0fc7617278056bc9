"""Train the five tiny configs back to back and tabulate final validation loss, perplexity and throughput.

    python -m benchmarks.train_tiny_all                       # all five, each with its config's max_steps
    python -m benchmarks.train_tiny_all --runs_dir /tmp/tiny  # elsewhere than checkpoints/
    python -m benchmarks.train_tiny_all -- --trainer.max_steps 100   # extra flags go to every run

Each run is ``python -m training.fit --config tiny_<variant> --runs_dir <runs_dir> --overwrite`` (fp32, CPU). Per
run: the last ``val_loss``, ``val_ppl`` and tokens / training second (also against tiny_gpt2), beside the unigram
entropy of the training tokens (a context-free model's loss). Throughput on a shared machine is noisy: the load
average around each run is recorded, and the median training step with the five models timed round-robin added.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from benchmarks.harness.paths import ROOT as REPO
from benchmarks.harness.runner import Study
from benchmarks.lib.study import last_val, trained
from benchmarks.lib.train_step import fit_command, interleaved_step_ms, timed_fit, unigram_entropy_of

VARIANTS = ["tiny_gpt2", "tiny_mla", "tiny_mla_kvsplice_50", "tiny_mla_kvsplice_70", "tiny_mla_kvsplice_90"]


def options(p) -> None:
    p.add_argument("--runs_dir", default="checkpoints", help="where the runs go")
    p.add_argument("--variants", nargs="*", default=VARIANTS, help="the tiny configs trained")
    p.add_argument("--rounds", type=int, help="round-robin rounds of the interleaved step timing")
    p.add_argument("extra", nargs="*", help="flags passed to every training run (after --)")


def _extra(run, flag: str):
    x = run.args.extra
    return next((x[i + 1] for i, f in enumerate(x[:-1]) if f == flag), None)


def rows(run):
    runs_dir = Path(run.args.runs_dir).resolve()
    for name in run.args.variants:
        cmd = fit_command(name, "--runs_dir", str(runs_dir), "--overwrite", *run.args.extra)  # read: <name>/
        run.say(f"== {' '.join(cmd[1:])}")
        fit = timed_fit(cmd)
        step, val_loss, _, _ = last_val(runs_dir / name / "metrics.csv")
        tokens, train_time = trained(runs_dir / name / "last.ckpt")
        row = dict(config=name, steps=step + 1, val_loss=val_loss, val_ppl=math.exp(val_loss), tokens=tokens,
                   train_time_s=train_time, tokens_per_sec=tokens / train_time, wall_s=fit["wall_s"],
                   load_before=fit["loadavg_before"][0], load_after=os.getloadavg()[0])
        run.say(f"   {name}: val_loss {val_loss:.4f}, ppl {row['val_ppl']:.2f}, {row['tokens_per_sec']:,.0f} tokens/s, "
                f"wall {fit['wall_s']:.0f} s")
        yield row


def summary(run, rows) -> dict:
    """The unigram entropy of the training tokens; each row's interleaved step time and speeds against tiny_gpt2."""
    h, desc, vocab = unigram_entropy_of(REPO / "configs" / f"{run.args.variants[0]}.yaml",
                                        _extra(run, "--data.cache_dir"))
    threads = _extra(run, "--torch_threads")
    step_ms = interleaved_step_ms([REPO / "configs" / f"{n}.yaml" for n in run.args.variants], vocab, run["rounds"],
                                  int(threads) if threads else None)
    ref = next((r for r in rows if r["config"] == "tiny_gpt2"), rows[0])
    ref_ms = step_ms[rows.index(ref)]
    for r, ms in zip(rows, step_ms):
        r.update(interleaved_step_ms=ms, vs_gpt2=r["tokens_per_sec"] / ref["tokens_per_sec"], step_vs_gpt2=ref_ms / ms)
    m = run.header["machine"]
    run.notes.update(unigram_entropy=h, data=desc, torch_threads=threads or "default", processor=m["processor"],
                     cpus=m["cores"])
    return {"unigram_entropy": h, "data": desc}


STUDY = Study("train_tiny_all", __doc__, rows, options=options, summary=summary, threads=None,
              bounds={"rounds": (1, 10000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
