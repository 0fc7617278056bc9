"""Evaluate training checkpoints side by side: ``kvsplice evaluate --ckpt PATH [--ckpt PATH ...]``.

For each checkpoint (loaded with ``weights_only=True``, see :mod:`training.checkpoint`):

* validation loss and perplexity over a stated number of tokens of the validation split the checkpoint was trained
  with (``--data.path`` / ``--data.tokenizer_path`` / ``--data.synthetic`` override it);
* KV-cache bytes per token, measured on the real cache after a real prefill + decode, checked against the formula,
  and at ``--context`` tokens; the compression vs an MHA model of the same shapes at the same dtype;
* decode tokens/s with the cache (median of ``--repeats``);
* sample generations from fixed prompts through the (compressed) cache.

Several checkpoints → one markdown table on stdout (``--json FILE`` writes everything, and the plots
``quality_vs_cache.png`` and ``val_loss.png`` next to it; an existing ``FILE`` is only replaced with ``--force``).
Bad input — a malformed option, a missing, corrupt, unsafe or foreign checkpoint, data that is not text — gives one
``kvsplice evaluate: error: ...`` line on stderr and exit status 2 (:func:`kvsplice.io.cli.run_cli`).
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice evaluate"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import dataclasses
import inspect
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from kvsplice.io.cli import EXIT_USAGE, Parser, UsageError, run_cli
from kvsplice.io.options import add_options, from_args
from kvsplice.io.files import output_file
from kvsplice.io.write import write_json
from kvsplice.report.memory import cache_bytes_formula, measure_cache, mha_cache_bytes, parse_dtype
from training.checkpoint import CheckpointError, load_gpt_checkpoint
from training.evaluate_options import EvaluateOptions

EXIT_ERROR = EXIT_USAGE
PROMPTS = ("Once upon a time", "One day, a little girl named Lily", "The dog was sad because")


class EvaluateError(RuntimeError):
    """Bad input for the evaluation (a reason to stop with one clear line)."""


def _datamodule(meta: dict, overrides: dict, block_size: int, tokens: int, batch_size: int):
    from data import TinyStoriesDataModule

    params = set(inspect.signature(TinyStoriesDataModule.__init__).parameters) - {"self"}
    hp = {k: v for k, v in (meta.get("data_hparams") or {}).items() if k in params}
    for k, v in overrides.items():
        if v is not None:
            hp[k] = v
    if overrides.get("path"):
        hp["synthetic"] = False
    if overrides.get("synthetic"):
        hp.pop("path", None)
        hp.pop("val_path", None)
    hp["block_size"] = block_size
    hp["batch_size"] = batch_size
    hp["val_batches"] = max(1, math.ceil(tokens / (batch_size * block_size)))
    dm = TinyStoriesDataModule(**hp)
    dm.prepare_data()
    dm.setup("validate")
    return dm


@torch.no_grad()
def validation_loss(model, dm, max_tokens: int) -> tuple[float, int]:
    """Mean next-token cross-entropy over all tokens of the first validation blocks (up to ``max_tokens``)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in dm.val_dataloader():
        x, y = x.to(device), y.to(device)  # (B, T)
        logits = model(x)  # (B, T, V)
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
        if count >= max_tokens:
            break
    return total / count, count


@torch.no_grad()
def cached_validation_loss(model, dm, max_tokens: int, chunk: int, quant: Optional[str] = None
                           ) -> tuple[float, int]:
    """:func:`validation_loss` with every token attending over the model's decode cache: each validation block is
    fed through a fresh ``model.new_cache(quant=quant)`` in chunks of ``chunk`` tokens (appended, then attended), so
    a quantised cache is what every query reads, its own chunk included."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in dm.val_dataloader():
        x, y = x.to(device), y.to(device)  # (B, T)
        cache = model.new_cache(x.shape[0], capacity=x.shape[1], quant=quant)
        logits = torch.cat([model(x[:, s:s + chunk], cache=cache) for s in range(0, x.shape[1], chunk)], dim=1)
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
        if count >= max_tokens:
            break
    return total / count, count


def quantised_loss(model, cfg, dm, opts: EvaluateOptions) -> dict[str, Any]:
    """Validation loss through the unquantised and the ``--cache-quant`` cache (same model, same tokens), the
    relative change, and the quantised cache's bytes per token (measured == formula)."""
    plain, _ = cached_validation_loss(model, dm, opts.tokens, opts.cache_chunk)
    quant, _ = cached_validation_loss(model, dm, opts.tokens, opts.cache_chunk, opts.cache_quant)
    measured = measure_cache_per_token(model, cfg.replace(cache_quant=opts.cache_quant), opts.cache_tokens,
                                       parse_dtype(opts.dtype))
    return {"cache_quant": opts.cache_quant, "val_loss_cached": plain, "val_loss_quant": quant,
            "val_loss_change": quant / plain - 1.0, "quant_bytes_per_token": measured["bytes_per_token"],
            "quant_cache_matches_formula": measured["measured_bytes"] == measured["formula_bytes"]}


@torch.no_grad()
def measure_cache_per_token(model, cfg, n_tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    """Real prefill + token-by-token decode into a fresh cache; measured bytes vs the formula."""
    device = next(model.parameters()).device
    n_tokens = min(n_tokens, cfg.block_size)
    n_decode = min(8, n_tokens - 1)
    idx = torch.randint(0, cfg.vocab_size, (1, n_tokens), device=device)
    m = model.to(dtype)
    cache = m.new_cache(1, capacity=n_tokens, quant=cfg.cache_quant)
    m(idx[:, : n_tokens - n_decode], cache=cache)
    for i in range(n_tokens - n_decode, n_tokens):
        m(idx[:, i : i + 1], cache=cache)
    model.float()
    meas = measure_cache(cache)
    formula = cache_bytes_formula(cfg, n_tokens, dtype)
    return {"tokens": n_tokens, "measured_bytes": meas.live_bytes, "storage_bytes": meas.storage_bytes,
            "formula_bytes": formula, "bytes_per_token": meas.live_bytes / n_tokens, "cache": type(cache).__name__}


@torch.no_grad()
def decode_speed(model, cfg, prompt_len: int, new_tokens: int, repeats: int) -> float:
    """Tokens/s of ``model.generate`` (prefill excluded): median over ``repeats`` runs, after one warm-up."""
    device = next(model.parameters()).device
    prompt_len = max(1, min(prompt_len, cfg.block_size - new_tokens - 1))
    idx = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
    times = []
    for r in range(repeats + 1):
        cache = model.new_cache(1, capacity=prompt_len + new_tokens)
        logits = model(idx, cache=cache)[:, -1]
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
            logits = model(nxt, cache=cache)[:, -1]
        if device.type == "cuda":
            torch.cuda.synchronize()
        if r:  # the first run warms up
            times.append(time.perf_counter() - t0)
    return new_tokens / statistics.median(times)


@torch.no_grad()
def samples(model, tokenizer, n_new: int, seed: int) -> list[dict[str, str]]:
    out = []
    device = next(model.parameters()).device
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        ids = ids[:, -max(1, model.cfg.block_size - n_new):]  # a prompt longer than the context keeps its end
        n = max(0, min(n_new, model.cfg.block_size - ids.shape[1]))
        g = torch.Generator(device=device).manual_seed(seed)
        gen = model.generate(ids, n, temperature=0.8, top_k=40, generator=g)
        out.append({"prompt": prompt, "text": tokenizer.decode(gen[0].tolist())})
    return out


def evaluate_checkpoint(path: str, opts: EvaluateOptions) -> dict[str, Any]:
    """The row of one checkpoint: validation loss, cache bytes (measured == formula), decode speed, samples."""
    model, cfg, meta = load_gpt_checkpoint(path)
    device = torch.device(opts.torch_device())
    model.to(device).eval()
    overrides = {"path": opts.data_path, "tokenizer_path": opts.data_tokenizer_path, "synthetic": opts.data_synthetic,
                 "cache_dir": opts.data_cache_dir}
    dm = _datamodule(meta, overrides, cfg.block_size, opts.tokens, opts.batch_size)
    if dm.vocab_size > cfg.vocab_size:
        raise EvaluateError(f"{path}: the data's tokenizer has {dm.vocab_size} tokens but the model only "
                        f"{cfg.vocab_size}; pass the --data.* settings the checkpoint was trained with")
    loss, n_tok = validation_loss(model, dm, opts.tokens)
    dtype = parse_dtype(opts.dtype)
    cache = measure_cache_per_token(model, cfg, opts.cache_tokens, dtype)
    mha_per_token = mha_cache_bytes(cfg, 1, dtype)  # an MHA model of the same shapes (any layout, any norms)
    row = {
        "checkpoint": str(path),
        "variant": cfg.variant,
        "steps": meta.get("global_step"),
        "val_loss": loss,
        "ppl": math.exp(loss),
        "val_tokens": n_tok,
        "dtype": opts.dtype,
        "cache_bytes_per_token": cache["bytes_per_token"],
        "cache_bytes_at_context": cache["bytes_per_token"] * opts.context,
        "context": opts.context,
        "compression_vs_mha": mha_per_token / cache["bytes_per_token"],
        "cache_matches_formula": cache["measured_bytes"] == cache["formula_bytes"],
        "cache_check": cache,
        "decode_tokens_per_s": decode_speed(model, cfg, opts.prompt_len, opts.decode_tokens, opts.repeats),
        "samples": samples(model, dm.tokenizer, opts.sample_tokens, opts.seed),
        "run_dir": str(Path(path).resolve().parent),
    }
    if opts.cache_quant:
        row.update(quantised_loss(model, cfg, dm, opts))
        row["quant_compression_vs_mha"] = mha_per_token / row["quant_bytes_per_token"]
    if not row["cache_matches_formula"]:
        raise EvaluateError(f"{path}: measured cache bytes {cache['measured_bytes']} != formula {cache['formula_bytes']}")
    return row


def results_markdown(rows: Sequence[dict[str, Any]], dtype: str, device: str) -> str:
    head = (f"| variant | steps | val loss | ppl | cache bytes/token ({dtype}) | compression vs MHA ({dtype}) "
            f"| decode tokens/s ({device}) |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['steps']} | {r['val_loss']:.4f} | {r['ppl']:.2f} | "
                     f"{r['cache_bytes_per_token']:.0f} | {r['compression_vs_mha']:.1f}× | "
                     f"{r['decode_tokens_per_s']:.1f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`EvaluateOptions` (its fields declare it)."""
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_options(p, EvaluateOptions, help={"force": "replace an existing --json file (and its plots)"})
    return p


def _check_device(opts: EvaluateOptions) -> EvaluateOptions:
    """``opts`` with its device resolved and checked (raises :class:`EvaluateError` naming ``--device``)."""
    try:
        device = torch.device(opts.torch_device())
    except RuntimeError as e:
        raise EvaluateError(f"--device {opts.device!r}: {str(e).splitlines()[0]}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvaluateError(f"--device {opts.device}: CUDA is not available on this machine (use --device cpu)")
    return dataclasses.replace(opts, device=opts.torch_device())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Evaluate the checkpoints of ``argv`` (default ``sys.argv[1:]``); returns the exit status (0, or
    :data:`EXIT_ERROR` after one ``kvsplice evaluate: error: ...`` line on stderr)."""
    from data import DataUnavailableError

    return run_cli(PROG, lambda: _main(argv), (CheckpointError, EvaluateError, DataUnavailableError))


def _main(argv: Optional[Sequence[str]]) -> int:
    try:
        opts = from_args(EvaluateOptions, build_parser().parse_args(argv))  # every count checked (one line)
    except UsageError as e:
        raise UsageError(f"{e} ({PROG} --help lists the options)") from None
    opts = _check_device(opts)
    json_path = None
    if opts.json:  # never a --ckpt, never replaced without --force, a writable folder
        json_path = output_file(opts.json, force=opts.force, option="--json", inputs={"--ckpt": list(opts.ckpt)})
    from training.checkpoint import check_resume_file

    for path in opts.ckpt:  # every checkpoint refused before the first progress line
        if not Path(path).is_file():
            raise CheckpointError(f"checkpoint '{path}' does not exist (or is not a file)")
        check_resume_file(path, "--ckpt")
    rows = []
    for path in opts.ckpt:
        print(f"evaluating {path} ...", file=sys.stderr)
        rows.append(evaluate_checkpoint(path, opts))
    print(results_markdown(rows, opts.dtype, opts.device))
    if opts.cache_quant:
        print(f"\n| variant | val loss (cache) | val loss ({opts.cache_quant} cache) | change | {opts.cache_quant} cache "
              f"bytes/token | vs MHA ({opts.dtype}) |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['val_loss_cached']:.4f} | {r['val_loss_quant']:.4f} | "
                  f"{100 * r['val_loss_change']:+.3f} % | {r['quant_bytes_per_token']:.0f} | "
                  f"{r['quant_compression_vs_mha']:.1f}× |")
    for r in rows:
        print(f"\n{r['variant']} samples ({Path(r['checkpoint']).name}):")
        for s in r["samples"]:
            print(f"  {s['text']!r}")
    if json_path is not None:
        out = json_path
        try:
            write_json({"dtype": opts.dtype, "device": opts.device, "rows": rows}, out)
        except OSError as e:
            raise UsageError(f"--json {opts.json}: cannot write ({e.strerror or type(e).__name__})") from None
        from kvsplice.report.plots import plot_quality_vs_cache, plot_val_loss

        plot_quality_vs_cache(rows, out.with_name(out.stem + "_quality_vs_cache.png"))
        csvs = [Path(r["run_dir"]) / "metrics.csv" for r in rows]
        csvs = [c for c in dict.fromkeys(csvs) if c.is_file()]
        if csvs:
            plot_val_loss(csvs, out.with_name(out.stem + "_val_loss.png"))
        print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
