"""Fit post-training low-rank KV bases for a pretrained model from calibration text.

    kvsplice fit-bases --model DIR|GGUF|HUB_ID|CKPT --fit F [F ...] \\
        (--rank R [R ...] | --energy E | --alloc-ratio X [X ...]) [--rank-v RV | --energy-v EV] [--rope post pre] \\
        --calib PATH [--calib-tokens N] [--calib-stats STATS.safetensors] [--seq-len T] [--batch-size B] \\
        [--device DEV] [--dtype fp32|bf16|fp16] --out FILE.safetensors|'b_{method}_{rope}_r{rank}.safetensors' \\
        [--force] [--json REPORT.json]

Methods ``ksvd``, ``eigen``, ``kq``, ``gqa-sum``, ``gqa-concat`` and ``fisher`` (loss-aware: needs the loss
gradients, which the calibration pass then also records), every ``--rank`` and every ``--rope`` mode are fitted
from **one** calibration pass (:func:`kvsplice.lowrank.sensitivity.calibrate_all`); ``--calib-stats FILE`` keeps
that pass's statistics and reuses them in later runs (other methods, ranks, allocations) without touching the
model's activations again. ``--alloc-ratio X`` fits bases whose per-layer, per-head key and value ranks are chosen
under a budget of ``2·L·Hkv·d / X`` cached numbers per token by the predicted calibration loss
(:mod:`kvsplice.lowrank.allocate`). With more than one (method, rope, rank) ``--out`` is a pattern with
``{method}``, ``{rope}`` and ``{rank}`` (``a2.00`` for an allocation).

Steps: load the model and its tokenizer (:mod:`kvsplice.loading`); tokenise the calibration text story by story
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

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice fit-bases"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from kvsplice.core.limits import check_fits
from kvsplice.io.cli import Parser, default_seq_len, device_dtype, first_line, run_cli
from kvsplice.io.files import cache_file, output_file
from kvsplice.io.options import add_options, from_args
from kvsplice.io.write import write_json
from kvsplice.lowrank.bases import BasesMismatchError, KVBases
from kvsplice.lowrank.options import CALIB_TOKENS, FitBasesOptions
from models.checkpoint import atomic_write

__all__ = ["FitError", "build_parser", "fit_one", "main", "time_forward"]


class FitError(RuntimeError):
    """A one-line error of the fit CLI."""


# ------------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`FitBasesOptions` (its fields declare it)."""
    p = Parser(prog=PROG, description="Fit post-training low-rank KV bases (SVD family) for a "
                                "GPT-2 / Llama / kvsplice-MHA model from calibration text.")
    add_options(p, FitBasesOptions, help={"force": "overwrite --out",
                                          "threads": "torch intra-op threads (1 is fastest on a busy CPU)"})
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
    from kvsplice.loading import iter_texts, token_stream

    ids, n_stories = token_stream(iter_texts(spec, option="calib", split="train"), loaded.tokenizer, n_tokens,
                                  progress=progress, desc="tokenize calib")
    if ids.numel() < seq_len:
        raise FitError(f"--calib {spec}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    batches = calibration_batches(ids, seq_len, batch_size, max_tokens=n_tokens)
    return batches, n_stories, ids.numel()


def spec_label(spec: dict[str, Any]) -> str:
    """The ``{rank}`` field of an output pattern: ``8``, ``e0.9``, or ``a2.00`` for an allocation."""
    if "alloc_ratio" in spec:
        return f"a{spec['alloc_ratio']:.2f}"
    return str(spec["rank"]) if spec["rank"] is not None else f"e{spec['energy']:g}"


def calibration(opts: FitBasesOptions, loaded, *, calib_cache: Optional[dict] = None) -> dict[str, Any]:
    """One calibration pass for every RoPE mode ``opts`` asks for (or the reused ``--calib-stats``, replaced with
    ``force``): ``{"stats": {mode: CalibrationStats}, "reused", "n_stories", "windows", timings}``; ``calib_cache``
    keeps the run in-process (benchmarks fitting many bases)."""
    from kvsplice.adapters import model_info
    from kvsplice.lowrank.sensitivity import stats_for

    n_tokens = opts.calib_tokens or CALIB_TOKENS
    progress = opts.progress
    info = model_info(loaded.model)
    seq_len = opts.seq_len or default_seq_len(loaded.max_positions)
    if loaded.max_positions is not None and seq_len > loaded.max_positions:
        raise FitError(f"--seq-len {seq_len} exceeds the model's {loaded.max_positions} positions")
    check_fits(f"--batch-size {opts.batch_size} with --seq-len {seq_len}", 4 * opts.batch_size * seq_len *
               loaded.tokenizer.vocab_size, "a forward's logits", next(loaded.model.parameters()).device)
    ropes = [r if info.has_rope else "none" for r in opts.rope]
    sens = bool(opts.sensitivity or opts.alloc_ratio or "fisher" in opts.fit)
    key = (str(opts.calib), n_tokens, seq_len, opts.batch_size, tuple(sorted(set(ropes))), sens)
    if calib_cache is not None and key in calib_cache:
        return calib_cache[key]
    run: dict[str, Any] = {"seq_len": seq_len, "tokenize_s": 0.0, "forward_s": None, "n_stories": None,
                           "windows": None}

    def batches():
        t0 = time.perf_counter()
        b, run["n_stories"], run["n_avail"] = _load_calib(loaded, opts.calib, n_tokens, seq_len,
                                                          opts.batch_size, progress)
        run["tokenize_s"] = time.perf_counter() - t0
        run["windows"] = sum(x.shape[0] for x in b)
        if opts.forward_timing:
            run["forward_s"] = time_forward(loaded.model, b)
        return b

    t0 = time.perf_counter()
    source = {"calibration_source": str(opts.calib), "calibration_tokens_asked": n_tokens,
              "seq_len": seq_len}
    stats, reused = stats_for(loaded.model, batches, path=opts.calib_stats, ropes=ropes,
                              sensitivity=sens, source=source, progress=progress, replace=opts.force)
    run["calibrate_s"] = time.perf_counter() - t0 - run["tokenize_s"] - (run["forward_s"] or 0.0)
    run.update(stats=stats, reused=reused, sensitivity=sens)
    if calib_cache is not None:
        calib_cache[key] = run
    return run


def check_ranks(loaded, specs: Sequence[dict[str, Any]]) -> None:
    """Every asked ``--rank`` / ``--rank-v`` fits the model's head_dim: checked before a calibration pass that may
    take minutes."""
    from kvsplice.adapters import model_info

    d = model_info(loaded.model).head_dim
    for spec in specs:
        for name in ("rank", "rank_v"):
            r = spec.get(name)
            if r is not None and r > d:
                raise FitError(f"--{name.replace('_', '-')} {r} exceeds the model's head_dim {d}")


def fit_job(loaded, run: dict[str, Any], method: str, rope: str, spec: dict[str, Any], opts: FitBasesOptions
            ) -> tuple[KVBases, dict[str, Any]]:
    """Fit one (method, rope, spec) from a :func:`calibration` run: the bases and a JSON-friendly report (its ranks
    checked by :func:`check_ranks` before the calibration)."""
    from kvsplice.adapters import model_info
    from kvsplice.lowrank.allocate import allocate_ranks
    from kvsplice.lowrank.fits import fit_bases

    info = model_info(loaded.model)
    d = info.head_dim
    stats = run["stats"][rope if info.has_rope else "none"]
    full_per_token = 2 * info.n_layer * info.n_kv_head * d
    dtype = torch.float64 if opts.bases_dtype == "fp64" else torch.float32
    t0 = time.perf_counter()
    alloc = None
    if "alloc_ratio" in spec:
        n = max(2 * info.n_layer * info.n_kv_head, min(full_per_token, round(full_per_token / spec["alloc_ratio"])))
        alloc = allocate_ranks(stats, n, method)
        bases = fit_bases(stats, method, ranks=alloc.ranks, dtype=dtype)
    else:
        bases = fit_bases(stats, method, rank=spec["rank"], energy=spec["energy"], rank_v=spec["rank_v"],
                          energy_v=spec["energy_v"], uniform_ranks=opts.uniform_ranks, dtype=dtype)
    fit_s = time.perf_counter() - t0
    calib_s, forward_s = run["calibrate_s"], run["forward_s"]
    bases.meta.update({
        "created_by": "kvsplice.fit_bases", "model": str(loaded.source),
        "calibration_source": str(opts.calib), "calibration_stories": run["n_stories"], "seq_len": run["seq_len"],
        "batch_size": opts.batch_size, "tokenizer": loaded.tokenizer.describe(),
        "timings_s": {"calibrate": round(calib_s, 4), "fit": round(fit_s, 4),
                      "plain_forward": None if forward_s is None else round(forward_s, 4)},
    })
    if alloc is not None:
        bases.meta.update({"alloc_ratio": spec["alloc_ratio"], "alloc_predicted_nll": alloc.predicted_nll,
                           **alloc.split()})
    ranks = bases.ranks()
    report: dict[str, Any] = {
        "model": loaded.describe(), "model_fingerprint": stats.fingerprint,
        "shapes": {"n_layer": info.n_layer, "n_head": info.n_head, "n_kv_head": info.n_kv_head, "head_dim": d,
                   "family": info.family},
        "method": method, "rope": stats.rope,
        "spec": {"rank": spec.get("rank"), "energy": spec.get("energy"), "rank_v": spec.get("rank_v"),
                 "energy_v": spec.get("energy_v"), "alloc_ratio": spec.get("alloc_ratio"),
                 "uniform_ranks": opts.uniform_ranks},
        "calibration": {"source": str(opts.calib), "tokens": stats.n_tokens, "stories": run["n_stories"],
                        "seq_len": run["seq_len"], "batch_size": opts.batch_size, "windows": run["windows"],
                        "stats_nbytes": stats.nbytes(), "reused_stats": run["reused"],
                        "stats_file": opts.calib_stats, "sensitivity": stats.has_sensitivity},
        "ranks_k": ranks["k"], "ranks_v": ranks["v"],
        "retained_k": bases.meta["retained_k"], "retained_v": bases.meta["retained_v"],
        "elements_per_token": bases.elements_per_token(), "full_elements_per_token": full_per_token,
        "compression": full_per_token / bases.elements_per_token(),
        "allocation": None if alloc is None else {"predicted_nll": alloc.predicted_nll, **alloc.split()},
        "timings_s": {"load": run.get("load_s"), "tokenize": run["tokenize_s"], "calibrate": calib_s, "fit": fit_s,
                      "plain_forward": forward_s,
                      "calibrate_plus_fit_over_forward": None if not forward_s else (calib_s + fit_s) / forward_s},
    }
    if not run["reused"] and run.get("n_avail", stats.n_tokens) < (opts.calib_tokens or CALIB_TOKENS):
        report["calibration"]["note"] = (f"the text has only {run['n_avail']} tokens; used {stats.n_tokens} "
                                         f"({stats.n_tokens // run['seq_len']} full windows)")
    return bases, report


def _load(opts: FitBasesOptions):
    from kvsplice.loading import load_model

    device, dtype = device_dtype(opts)
    return load_model(opts.model, tokenizer=opts.tokenizer, dtype=dtype, device=device)


def fit_one(opts: FitBasesOptions, loaded=None, calib_cache: Optional[dict] = None
                ) -> tuple[KVBases, dict[str, Any]]:
    """One (method, rope, spec) — the first ``opts`` asks for — fitted: the bases and a JSON-friendly report.
    ``loaded``: an already loaded :class:`kvsplice.loading.LoadedModel`; ``calib_cache``: a dict that keeps the
    calibration run per (text, tokens, seq_len, batch size, RoPE modes) — to fit several bases from one calibration,
    e.g. in benchmarks (the report then repeats that calibration's times)."""
    t0 = time.perf_counter()
    loaded = loaded if loaded is not None else _load(opts)
    load_s = time.perf_counter() - t0
    method, rope, spec = opts.jobs()[0]
    check_ranks(loaded, [spec])
    run = calibration(opts, loaded, calib_cache=calib_cache)
    run.setdefault("load_s", load_s)
    return fit_job(loaded, run, method, rope, spec, opts)


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
    from kvsplice.loading import LoadError

    return run_cli(PROG, lambda: _main(argv), (FitError, LoadError, BasesMismatchError))


def _outputs(opts: FitBasesOptions, todo: list) -> list[Path]:
    """The output file of every job: ``--out`` itself for one, the pattern filled in for several."""
    if len(todo) == 1 and not any(f in opts.out for f in ("{fit}", "{method}", "{rope}", "{rank}")):
        return [Path(opts.out)]
    if len(todo) > 1 and not all(f in opts.out for f in _fields_needed(todo)):
        raise FitError(f"--out {opts.out}: {len(todo)} bases (methods × RoPE modes × ranks) need a pattern with "
                       f"{', '.join(_fields_needed(todo))}, e.g. 'bases_{{method}}_{{rope}}_r{{rank}}.safetensors'")
    try:
        outs = [Path(opts.out.format(fit=m, method=m, rope=rope, rank=spec_label(spec))) for m, rope, spec in todo]
    except (KeyError, IndexError, ValueError) as e:
        raise FitError(f"--out {opts.out}: not a pattern of {{method}}, {{rope}}, {{rank}} ({first_line(e)})") from None
    if len(set(outs)) != len(outs):
        raise FitError(f"--out {opts.out}: the pattern gives the same file to two bases")
    return outs


def _fields_needed(todo: list) -> list[str]:
    return [f"{{{name}}}" for name, i in (("method", 0), ("rope", 1), ("rank", 2))
            if len({str(t[i]) if i < 2 else spec_label(t[2]) for t in todo}) > 1]


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = from_args(FitBasesOptions, build_parser().parse_args(argv))  # every count and spec checked (one line)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    todo = opts.jobs()
    inputs = {"--model": opts.model, "--tokenizer": opts.tokenizer, "--calib": opts.calib,
              "--calib-stats": opts.calib_stats}  # an existing stats file is an input
    outs = [output_file(o, force=opts.force, inputs=inputs) for o in _outputs(opts, todo)]
    written = {f"--out {o}": o for o in outs}
    json_path = None if opts.json is None else output_file(
        opts.json, force=opts.force, option="--json", inputs=inputs, outputs=written)
    cache_file(opts.calib_stats, option="--calib-stats", inputs=inputs,
               outputs={**written, **({"--json": json_path} if json_path else {})})
    from kvsplice.loading import text_tokens

    opts = dataclasses.replace(opts, calib_tokens=text_tokens("--calib-tokens", opts.calib_tokens, CALIB_TOKENS,
                                                              opts.calib, text_option="calib"))  # before loading
    t0 = time.perf_counter()
    loaded = _load(opts)
    check_ranks(loaded, [spec for _, _, spec in todo])
    run = calibration(opts, loaded)
    run["load_s"] = time.perf_counter() - t0
    reports = []
    for (method, rope, spec), out in zip(todo, outs):
        bases, report = fit_job(loaded, run, method, rope, spec, opts)
        atomic_write(out, bases.save)  # a temporary sibling renamed into place
        report["out"] = str(out)
        print_report(report)
        print(f"saved {out}")
        reports.append(report)
    if len(todo) > 1:
        fit_total = sum(r["timings_s"]["fit"] for r in reports)
        fwd = run["forward_s"]
        print(f"{len(todo)} bases from one calibration pass{' (reused stats)' if run['reused'] else ''}: "
              f"calibration {run['calibrate_s']:.1f} s + fits {fit_total:.1f} s"
              + (f" = {(run['calibrate_s'] + fit_total) / fwd:.2f} plain forward passes" if fwd else ""))
    if json_path is not None:
        write_json(reports[0] if len(reports) == 1 else {"bases": reports}, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
