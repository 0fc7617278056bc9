"""Perplexity of a continuation decoded over a token-selected (compressed) prompt cache: BalanceKV vs baselines.

    python -m benchmarks.balance_ppl                      # stories260K → results/balance_ppl.json + .png (≈ 2 min)
    python -m benchmarks.balance_ppl --model DIR|CKPT --data PATH [--prompt 384] [--cont 128] [--windows 64]
        [--ratios 2 4 8] [--seeds 3] [--json results/balance_ppl.json]

For every window of ``prompt + cont`` tokens of real text (the model's tokenizer, stories BOS/EOS-separated by
:mod:`kvsplice.loading`): the prompt is prefilled exactly (full attention), every layer's K/V (post-RoPE keys for
Llama) is compressed per KV head to ``budget = prompt // ratio`` tokens by the method, and the continuation is decoded
teacher-forced over that cache with weighted attention (decoded tokens kept exactly; positions continue from the
tokens seen) — :func:`kvsplice.select.method.run_token_selection`. Scored: every continuation token (the first is
predicted by the exact prefill). Perplexity = exp(total NLL / tokens) over all windows; random methods are repeated
over ``--seeds`` and reported as mean ± std.

Methods (``n_sink = 4``, ``n_recent = 16``, ``block_size = 64``, walk threshold ``c = median κ``):

* ``full`` — no compression (budget = prompt): the reference; checked against the HF model's own logits.
* ``balancekv`` — sinks + recent intact, the middle halved by the self-balancing walk (``balance_plan``: the fewest
  halvings ``T`` that reach the budget, oldest tokens halved most).
* ``uniform`` — sinks + recent intact, the rest of the budget sampled uniformly from the middle (weight n/k).
* ``streamingllm`` — the first 4 tokens + the most recent ``budget − 4`` (weights 1).
* ``coinflip`` — ablation: exactly BalanceKV's plan (same intact tokens, same segments and weights), but each
  block's halving is a uniformly random exact half (``c_scale = inf``): the difference to ``balancekv`` is the walk's.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch


from benchmarks.harness.header import command as command_line, revision
from benchmarks.harness.options import add_json, add_model, add_threads, add_windows, command, parser
from benchmarks.harness.paths import RESULTS, STORIES

from kvsplice.loading import LoadError, first_line, iter_texts, load_model, token_stream
from kvsplice.select.method import run_token_selection
from kvsplice.select.selectors import (BalanceKVSelector, StreamingLLMSelector, UniformSelector,
                                   balance_plan)

METHODS = ("full", "balancekv", "uniform", "streamingllm", "coinflip")
COMPRESSED = METHODS[1:]
N_SINK, N_RECENT, BLOCK = 4, 16, 64


def make(method: str, seed: int):
    if method == "balancekv":
        return BalanceKVSelector(n_sink=N_SINK, n_recent=N_RECENT, block_size=BLOCK, seed=seed)
    if method == "coinflip":  # ablation: BalanceKV's plan and blocks, every halving a fair coin (c = inf)
        return BalanceKVSelector(n_sink=N_SINK, n_recent=N_RECENT, block_size=BLOCK, c_scale=math.inf, seed=seed)
    if method == "uniform":
        return UniformSelector(n_sink=N_SINK, n_recent=N_RECENT, seed=seed)
    if method in ("streamingllm", "full"):
        return StreamingLLMSelector(n_sink=N_SINK, seed=seed)
    raise ValueError(method)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, prompt: int, method: str, budget: int, seed: int, batch: int) -> dict:
    """Total NLL / tokens of the continuation over all windows for one method, budget and seed."""
    sel = make(method, seed)
    total, n = 0.0, 0
    nbytes = full = 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch]
        res = run_token_selection(model, ids, sel, budget, prompt_len=prompt)
        total += res.nll * res.n_scored
        n += res.n_scored
        nbytes, full = res.cache_nbytes, res.full_nbytes
    return {"nll": total / n, "ppl": math.exp(total / n), "tokens": n, "cache_nbytes_last_batch": nbytes,
            "full_nbytes_last_batch": full}


@torch.no_grad()
def hf_reference_nll(model, windows: torch.Tensor, prompt: int, batch: int) -> float:
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch]
        out = model(ids)
        logits = (out if isinstance(out, torch.Tensor) else out.logits)[:, prompt - 1:-1].float()
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, prompt:].reshape(-1),
                                                   reduction="sum").item()
        n += ids[:, prompt:].numel()
    return total / n


def plot(report: dict, out_png: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ratios = report["config"]["ratios"]
    full = report["full"]["ppl"]
    width = 0.8 / len(COMPRESSED)
    for j, m in enumerate(COMPRESSED):
        ys = [report["results"][str(r)][m]["ppl_mean"] for r in ratios]
        es = [report["results"][str(r)][m]["ppl_std"] for r in ratios]
        xs = [i + (j - (len(COMPRESSED) - 1) / 2) * width for i in range(len(ratios))]
        ax.bar(xs, ys, width, yerr=es, capsize=3, label=m)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    ax.axhline(full, color="k", ls="--", lw=1, label=f"full cache {full:.2f}")
    ax.set_xticks(range(len(ratios)), [f"{r}× (budget {report['results'][str(r)]['budget']})" for r in ratios])
    ax.set_ylabel("continuation perplexity")
    lo = min(full, *(report["results"][str(r)][m]["ppl_mean"] for r in ratios
                     for m in COMPRESSED))
    ax.set_ylim(bottom=max(0.0, lo * 0.9))
    cfg = report["config"]
    ax.set_title(f"{cfg['model_name']}: prompt {cfg['prompt']} compressed, {cfg['cont']} decoded, "
                 f"{cfg['windows']} windows", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


def to_markdown(report: dict) -> str:
    ratios = report["config"]["ratios"]
    lines = ["| method | " + " | ".join(f"{r}× (budget {report['results'][str(r)]['budget']})" for r in ratios)
             + " |", "|---|" + "---|" * len(ratios)]
    lines.append(f"| full cache ({report['config']['prompt']}) | "
                 + " | ".join(f"{report['full']['ppl']:.3f}" for _ in ratios) + " |")
    for m in COMPRESSED:
        cells = []
        for r in ratios:
            x = report["results"][str(r)][m]
            cells.append(f"{x['ppl_mean']:.3f} ± {x['ppl_std']:.3f}" if x["seeds"] > 1 else f"{x['ppl_mean']:.3f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@command
def main(argv=None) -> int:
    p = parser(__file__, __doc__)
    add_model(p, help="HF model dir or .ckpt (default: stories260K, converted to a temp dir)")
    add_windows(p, 64)
    p.add_argument("--ratios", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    add_json(p, RESULTS / "balance_ppl.json")
    add_threads(p)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    tmp = None
    try:
        spec = a.model
        if spec is None:
            from kvsplice.convert.llama2c import convert_llama2c

            if not (STORIES / "stories260K.bin").is_file():
                raise LoadError(f"stories260K not found under {STORIES}; pass --model")
            tmp = tempfile.TemporaryDirectory(prefix="stories260K-hf-")
            spec = str(convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", Path(tmp.name) / "m"))
        loaded = load_model(spec)
        model, tok = loaded.model, loaded.tokenizer
        seq = a.prompt + a.cont
        if loaded.max_positions is not None and seq > loaded.max_positions:
            raise LoadError(f"--prompt + --cont = {seq} exceeds the model's {loaded.max_positions} positions")
        ids, n_stories = token_stream(iter_texts(a.data), tok, max_tokens=seq * a.windows)
        n_win = ids.numel() // seq
        if n_win < 1:
            raise LoadError(f"--data has {ids.numel()} tokens, fewer than one window of {seq}")
        windows = ids[: n_win * seq].view(n_win, seq)
    except LoadError as e:
        print(f"balance_ppl: error: {first_line(e)}", file=sys.stderr)
        return 2
    model_name = "stories260K" if a.model is None else a.model
    full = evaluate(model, windows, a.prompt, "full", a.prompt, 0, a.batch)
    hf = hf_reference_nll(model, windows, a.prompt, a.batch)
    full["hf_model_nll"] = hf
    full["matches_hf_model"] = abs(full["nll"] - hf) < 1e-4
    print(f"full cache: ppl {full['ppl']:.4f} (HF model {math.exp(hf):.4f}) [{time.time() - t0:.0f}s]", flush=True)
    results = {}
    for r in a.ratios:
        budget = a.prompt // r
        s, segs = balance_plan(a.prompt, budget, N_SINK, N_RECENT)
        res = {"budget": budget, "balancekv_plan": {"sinks": s, "segments (start, length, halvings)": segs,
                                                    "intact_recent": a.prompt - (segs[-1][0] + segs[-1][1])
                                                    if segs else budget - s}}
        for m in COMPRESSED:
            seeds = 1 if m == "streamingllm" else a.seeds
            runs = [evaluate(model, windows, a.prompt, m, budget, sd, a.batch) for sd in range(seeds)]
            ppl = torch.tensor([x["ppl"] for x in runs])
            res[m] = {"ppl_mean": float(ppl.mean()), "ppl_std": float(ppl.std()) if seeds > 1 else 0.0,
                      "ppl_per_seed": ppl.tolist(), "nll_mean": float(torch.tensor([x["nll"] for x in runs]).mean()),
                      "seeds": seeds, "cache_nbytes_last_batch": runs[0]["cache_nbytes_last_batch"]}
            print(f"{r}x (budget {budget}) {m}: ppl {res[m]['ppl_mean']:.4f} ± {res[m]['ppl_std']:.4f} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
        results[str(r)] = res
    report = {
        "config": {"model_name": model_name, "data": str(Path(a.data).name), "prompt": a.prompt, "cont": a.cont,
                   "windows": n_win, "stories": n_stories, "ratios": a.ratios, "seeds": a.seeds, "n_sink": N_SINK,
                   "n_recent": N_RECENT, "block_size": BLOCK, "walk_threshold": "c = 1.0 * median kappa per block",
                   "scored_tokens": n_win * a.cont, "model": loaded.describe()},
        "full": full,
        "results": results,
        "seconds": round(time.time() - t0, 1),
        "command": command_line(__file__, argv), "revision": revision(),
    }
    md = to_markdown(report)
    report["markdown"] = md
    print(md)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    png = plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {png} ({report['seconds']}s)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
