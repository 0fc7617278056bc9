"""Fit post-training low-rank KV bases for a pretrained model from calibration text.

    python -m kvsplice.fit_bases --model DIR|HUB_ID|CKPT --method ksvd|eigen|kq|gqa-sum|gqa-concat \\
        (--rank R | --energy E) [--rank-v RV | --energy-v EV] [--rope post|pre] --calib PATH \\
        [--calib-tokens N] [--seq-len T] [--batch-size B] --out FILE.safetensors [--force] [--json REPORT.json]

Steps: load the model and its tokenizer (:mod:`kvsplice.io.loading`); tokenise the calibration text story by story
(BOS / EOS between stories, as the tokenizer does) up to ``--calib-tokens``; cut it into ``--seq-len`` windows
(default: the model's context, at most 1024 — post-RoPE bases should see every position they will decode at); time
one plain forward pass of the model over those windows (logits, no hooks); stream the windows through
:func:`kvsplice.lowrank.calibrate.calibrate` (d×d Grams, never activations); fit with :func:`kvsplice.lowrank.fits.fit_bases`;
save with :meth:`kvsplice.lowrank.bases.KVBases.save` (metadata: model fingerprint, method, RoPE mode, ranks, retained
energy, calibration tokens and source, timings).

Printed: the ranks per layer and KV head (they differ per head with ``--energy``) with the retained fraction of
each fit's objective spectrum, the cached numbers per token vs the full K/V cache, and the times —
``(calibration + fit) / plain forward`` is the cost of fitting relative to one forward pass over the same text.

Errors (missing files, unsupported models, offline hub ids, bad ranks, a read-only destination) are one line on
stderr with exit status 2; ``--out`` is never overwritten without ``--force``, never an input, and is written
atomically.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence

import torch

from kvsplice.io.cli import Parser, default_seq_len, pos_int, run_cli
from kvsplice.io.outputs import out_and_json, write_json
from kvsplice.lowrank.bases import BasesMismatchError, KVBases
from kvsplice.lowrank.fits import METHODS
from models.checkpoint import atomic_write

__all__ = ["FitError", "build_parser", "fit_from_args", "main", "time_forward"]

PROG = "fit_bases"


class FitError(RuntimeError):
    """A one-line error of the fit CLI."""


# ------------------------------------------------------------------------------------------------ parser
def _energy(s: str) -> float:
    v = float(s)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m kvsplice.fit_bases", description="Fit post-training low-rank KV bases (SVD family) for a "
                                "GPT-2 / Llama / kvsplice-MHA model from calibration text.")
    p.add_argument("--model", required=True, help="model directory with config.json (e.g. made by python -m "
                   "kvsplice.convert_llama2c), a training .ckpt, or a Hugging Face Hub id")
    p.add_argument("--tokenizer", help="override the model's tokenizer (HF tokenizer dir, GPT-2 BPE files or "
                   "tokenizer.json)")
    p.add_argument("--method", required=True, choices=METHODS, help="ksvd: K-only/V-only SVD; eigen: joint SVD "
                   "of [K;Q]; kq / gqa-concat: attention-aware (per-head scores), gqa-sum: attention-aware on "
                   "the group-summed queries; kq/gqa-* values are W_O-aware")
    spec = p.add_mutually_exclusive_group(required=True)
    spec.add_argument("--rank", type=pos_int, help="key rank per KV head (<= head_dim)")
    spec.add_argument("--energy", type=_energy, help="per head, the smallest key rank retaining this fraction of "
                      "the fit's spectrum (e.g. 0.9)")
    vspec = p.add_mutually_exclusive_group()
    vspec.add_argument("--rank-v", type=pos_int, help="value rank (default: the key spec)")
    vspec.add_argument("--energy-v", type=_energy, help="value energy (default: the key spec)")
    p.add_argument("--uniform-ranks", action="store_true", help="with --energy: raise every head of a layer to "
                   "the layer's largest rank (one cache stream per layer)")
    p.add_argument("--rope", choices=("post", "pre"), default="post", help="RoPE models: project keys after "
                   "(post, default) or before (pre) the rotary embedding; ignored for models without RoPE")
    p.add_argument("--calib", required=True, help="calibration text: .txt (<|endoftext|> or blank-line "
                   "separated stories), .json, .jsonl, a folder of them, or a Hugging Face dataset ID[:SPLIT]")
    p.add_argument("--calib-tokens", type=pos_int, default=65536, help="calibration tokens (default 65536)")
    p.add_argument("--seq-len", type=pos_int, help="window length (default: the model's context, <= 1024)")
    p.add_argument("--batch-size", type=pos_int, default=8, help="windows per forward (default 8)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--json", help="also write the report as JSON here")
    p.add_argument("--dtype", choices=("fp32", "fp64"), default="fp32", help="dtype of the saved bases")
    p.add_argument("--threads", type=pos_int, help="torch intra-op threads (1 is fastest on a busy CPU)")
    p.add_argument("--no-forward-timing", action="store_true", help="skip the plain forward pass timing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


# ------------------------------------------------------------------------------------------------ helpers
@torch.no_grad()
def time_forward(model: torch.nn.Module, batches: Sequence[torch.Tensor]) -> float:
    """Seconds of one plain forward pass (logits, no hooks, no KV cache) over ``batches`` (after a warm-up on a
    slice of the first batch)."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device

    def fwd(x: torch.Tensor) -> None:
        x = x.to(device)
        if hasattr(model, "config"):  # transformers
            model(input_ids=x, use_cache=False)
        else:  # models.GPT
            model(x)

    try:
        fwd(batches[0][:1, : min(16, batches[0].shape[1])])
        t0 = time.perf_counter()
        for b in batches:
            fwd(b)
        return time.perf_counter() - t0
    finally:
        model.train(was)


def _load_calib(loaded, spec: str, n_tokens: int, seq_len: int, batch_size: int, progress: bool):
    from kvsplice.lowrank.calibrate import calibration_batches
    from kvsplice.io.loading import iter_texts, token_stream

    ids, n_stories = token_stream(iter_texts(spec, option="calib", split="train"), loaded.tokenizer, n_tokens,
                                  progress=progress, desc="tokenize calib")
    if ids.numel() < seq_len:
        raise FitError(f"--calib {spec}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    batches = calibration_batches(ids, seq_len, batch_size, max_tokens=n_tokens)
    return batches, n_stories, ids.numel()


# ------------------------------------------------------------------------------------------------ the fit
def fit_from_args(args: argparse.Namespace, loaded=None, calib_cache: Optional[dict] = None
                  ) -> tuple[KVBases, dict[str, Any]]:
    """Everything but the saving: returns the bases and a JSON-friendly report. ``loaded``: an already loaded
    :class:`kvsplice.io.loading.LoadedModel`; ``calib_cache``: a dict that keeps the calibration run (tokens, Grams,
    timings) per (text, tokens, seq_len, batch size, RoPE mode) — to fit several bases from one calibration, e.g. in
    benchmarks (the report then repeats that calibration's times)."""
    from kvsplice.adapters import model_info
    from kvsplice.lowrank.calibrate import calibrate
    from kvsplice.lowrank.fits import fit_bases
    from kvsplice.io.loading import load_model

    progress = not getattr(args, "no_progress", False)
    t0 = time.perf_counter()
    if loaded is None:
        loaded = load_model(args.model, tokenizer=getattr(args, "tokenizer", None))
    load_s = time.perf_counter() - t0
    info = model_info(loaded.model)
    d = info.head_dim
    for name in ("rank", "rank_v"):
        r = getattr(args, name, None)
        if r is not None and r > d:
            raise FitError(f"--{name.replace('_', '-')} {r} exceeds the model's head_dim {d}")
    seq_len = args.seq_len or default_seq_len(loaded.max_positions)
    if loaded.max_positions is not None and seq_len > loaded.max_positions:
        raise FitError(f"--seq-len {seq_len} exceeds the model's {loaded.max_positions} positions")
    rope = args.rope if info.has_rope else None

    key = (str(args.calib), args.calib_tokens, seq_len, args.batch_size, rope or "none")
    if calib_cache is not None and key in calib_cache:
        run = calib_cache[key]
    else:
        t0 = time.perf_counter()
        batches, n_stories, n_avail = _load_calib(loaded, args.calib, args.calib_tokens, seq_len, args.batch_size,
                                                  progress)
        tok_s = time.perf_counter() - t0
        forward_s = None if getattr(args, "no_forward_timing", False) else time_forward(loaded.model, batches)
        t0 = time.perf_counter()
        stats = calibrate(loaded.model, batches, rope=rope, progress=progress)
        calib_s = time.perf_counter() - t0
        run = {"stats": stats, "n_stories": n_stories, "n_avail": n_avail, "windows": sum(b.shape[0] for b in batches),
               "tokenize_s": tok_s, "forward_s": forward_s, "calibrate_s": calib_s}
        if calib_cache is not None:
            calib_cache[key] = run
    stats, n_stories, n_avail = run["stats"], run["n_stories"], run["n_avail"]
    tok_s, forward_s, calib_s = run["tokenize_s"], run["forward_s"], run["calibrate_s"]
    n_calib = stats.n_tokens
    t0 = time.perf_counter()
    dtype = torch.float64 if getattr(args, "dtype", "fp32") == "fp64" else torch.float32
    bases = fit_bases(stats, args.method, rank=args.rank, energy=args.energy, rank_v=args.rank_v,
                      energy_v=args.energy_v, uniform_ranks=getattr(args, "uniform_ranks", False), dtype=dtype)
    fit_s = time.perf_counter() - t0

    full_per_token = 2 * info.n_layer * info.n_kv_head * info.head_dim
    bases.meta.update({
        "created_by": "kvsplice.fit_bases",
        "model": str(loaded.source),
        "calibration_source": str(args.calib),
        "calibration_stories": n_stories,
        "seq_len": seq_len,
        "batch_size": args.batch_size,
        "tokenizer": loaded.tokenizer.describe(),
        "timings_s": {"calibrate": round(calib_s, 4), "fit": round(fit_s, 4),
                      "plain_forward": None if forward_s is None else round(forward_s, 4)},
    })
    ranks = bases.ranks()
    report: dict[str, Any] = {
        "model": loaded.describe(),
        "model_fingerprint": stats.fingerprint,
        "shapes": {"n_layer": info.n_layer, "n_head": info.n_head, "n_kv_head": info.n_kv_head, "head_dim": d,
                   "family": info.family},
        "method": args.method, "rope": stats.rope,
        "spec": {"rank": args.rank, "energy": args.energy, "rank_v": args.rank_v, "energy_v": args.energy_v,
                 "uniform_ranks": getattr(args, "uniform_ranks", False)},
        "calibration": {"source": str(args.calib), "tokens": n_calib, "stories": n_stories, "seq_len": seq_len,
                        "batch_size": args.batch_size, "windows": run["windows"],
                        "stats_nbytes": stats.nbytes()},
        "ranks_k": ranks["k"], "ranks_v": ranks["v"],
        "retained_k": bases.meta["retained_k"], "retained_v": bases.meta["retained_v"],
        "elements_per_token": bases.elements_per_token(), "full_elements_per_token": full_per_token,
        "compression": full_per_token / bases.elements_per_token(),
        "timings_s": {"load": load_s, "tokenize": tok_s, "calibrate": calib_s, "fit": fit_s,
                      "plain_forward": forward_s,
                      "calibrate_plus_fit_over_forward": None if not forward_s else (calib_s + fit_s) / forward_s},
    }
    if n_calib < args.calib_tokens:
        report["calibration"]["note"] = (f"the text has only {n_avail} tokens; used {n_calib} "
                                         f"({n_calib // seq_len} full windows)")
    return bases, report


# ------------------------------------------------------------------------------------------------ output
def _fmt_ranks(rs: list[int]) -> str:
    return str(rs[0]) if len(set(rs)) == 1 else ",".join(map(str, rs))


def print_report(report: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 120))
    sh = report["shapes"]
    title = (f"{report['method']} bases, rope={report['rope']} — {sh['family']}: {sh['n_layer']} layers, "
             f"{sh['n_head']} query / {sh['n_kv_head']} KV heads, head_dim {sh['head_dim']}")
    t = Table(title=title)
    for col in ("layer", "R_k per KV head", "R_v per KV head", "retained K (min / mean)",
                "retained V (min / mean)"):
        t.add_column(col, justify="right")
    for l, (rk, rv, ek, ev) in enumerate(zip(report["ranks_k"], report["ranks_v"], report["retained_k"],
                                             report["retained_v"])):
        t.add_row(str(l), _fmt_ranks(rk), _fmt_ranks(rv), f"{min(ek):.4f} / {sum(ek) / len(ek):.4f}",
                  f"{min(ev):.4f} / {sum(ev) / len(ev):.4f}")
    console.print(t)
    c, tm = report["calibration"], report["timings_s"]
    console.print(f"calibration: {c['tokens']:,} tokens ({c['windows']} windows × {c['seq_len']}, "
                  f"{c['stories']} stories) from {c['source']}; stats {c['stats_nbytes']:,} bytes"
                  + (f" — {c['note']}" if "note" in c else ""), soft_wrap=True)
    console.print(f"cache: {report['elements_per_token']} numbers per token vs {report['full_elements_per_token']} "
                  f"for the full K/V cache ({report['compression']:.2f}× smaller)", soft_wrap=True)
    fwd = tm["plain_forward"]
    line = f"time: calibration {tm['calibrate']:.3f} s + fit {tm['fit']:.3f} s"
    if fwd:
        line += (f"; one plain forward pass over the same text {fwd:.3f} s → (calibration + fit) / forward = "
                 f"{tm['calibrate_plus_fit_over_forward']:.2f}")
    console.print(line, soft_wrap=True)


# ------------------------------------------------------------------------------------------------ main
def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.io.loading import LoadError

    return run_cli(PROG, lambda: _main(argv), (FitError, LoadError, BasesMismatchError))


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out, json_path = out_and_json(args.out, args.json, force=args.force,
                                  inputs={"--model": args.model, "--tokenizer": args.tokenizer,
                                          "--calib": args.calib})
    bases, report = fit_from_args(args)
    atomic_write(out, bases.save)  # a temporary sibling renamed into place
    report["out"] = str(out)
    print_report(report)
    print(f"saved {out}")
    if json_path is not None:
        write_json(report, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
