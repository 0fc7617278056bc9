"""Convert a trained MHA model into MLA (and/or insert KVSplice into an MLA model): a checkpoint of our GPT, or a
pretrained Llama-family model into a decoupled-RoPE MLA model folder.

    kvsplice to-mla --model LLAMA_DIR_OR_GGUF --calib TEXT --d-latent R|full --rope-dims D|all \
        --rope-layout per-head|shared [--latent-norm] [--kvsplice-keep f] [--format native|deepseek_v3] --out DIR

(Llama / Mistral / Qwen2 / Qwen3: :mod:`kvsplice.convert.llama_run`; ``--model`` a converted folder with
``--kvsplice-keep`` shrinks its latent; docs/conversion.md. The options, declared once:
:class:`kvsplice.convert.to_mla_options.ToMLAOptions`.) For our GPT:

    kvsplice to-mla --model M --d-latent R [--kvsplice-keep f] [--calib TEXT --calib-tokens N] \\
        --out OUT.ckpt [--force] [--json REPORT.json]

``M``: a ``training.fit`` checkpoint (MHA/GQA, or MLA for ``--kvsplice-keep`` alone) or an HF GPT-2 directory / Hub
id (imported with ``GPT.from_hf``). MHA → MLA factorises each layer's stacked key/value projection into
``w_dkv`` / ``w_uk`` / ``w_uv`` (:mod:`kvsplice.convert.mla`): from the weights alone, or — with ``--calib`` —
minimising the key/value error on the calibration text's attention inputs (streamed Grams). ``--kvsplice-keep f``
(the kept fraction of the latent: 0.1 keeps 10 %, the model called KVSplice-90; "ratio" means times smaller
everywhere else; ``--kvsplice-ratio`` is still accepted, with a note) then inserts KVSplice, ``compress``
initialised from the top principal directions of the calibration latents
(``--kvsplice-init pca``, needs ``--calib``) or randomly orthogonal (``--kvsplice-init random``).

The output is a checkpoint that ``training.evaluate``, ``kvsplice.verify_memory --ckpt`` and
``training.fit --config ... --model.init_from OUT.ckpt`` (fine-tuning with a fresh optimizer and schedule) accept;
it keeps the source's data settings, so the tokenizer and validation text follow. Printed: the relative error of
the keys/values on the calibration text and the cache per token before and after. A folder output carries the
marker that to_mla wrote it (:data:`kvsplice.io.marker.MARKER`): ``--force`` replaces only such a folder, whole;
``--json`` is never a file inside it.

Errors are one line on stderr, exit status 2; ``--out`` is never overwritten without ``--force`` and never an input
(``--model``, ``--calib``, ``--tokenizer``), and is written atomically (a killed run's temporary file is removed by
the next run).
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice to-mla"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from kvsplice.convert.to_mla_options import CALIB_TOKENS, OLD_KEEP, ToMLAOptions
from kvsplice.io.cli import Parser, UsageError, apply_threads, default_seq_len, device_dtype, pos_int, run_cli
from kvsplice.io.files import out_and_json
from kvsplice.io.options import add_options, from_args
from kvsplice.io.write import disk_errors, write_json

__all__ = ["build_parser", "convert_gpt", "main"]


def keep_note(opts: ToMLAOptions) -> None:
    """The one ``note:`` line of the old spelling."""
    if opts.keep_option == OLD_KEEP:
        print(f"note: {OLD_KEEP} is the kept fraction of the latent, now spelled --kvsplice-keep", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`ToMLAOptions` (its fields declare it); the outputs in their own group."""
    p = Parser(prog=PROG, description="Convert a trained MHA GPT into MLA / MLA + KVSplice.")
    outputs = p.add_argument_group("outputs")
    add_options(p, ToMLAOptions, groups=dict.fromkeys(("out", "json", "force"), outputs),
                help={"force": "overwrite --out / --json (a folder: only one to_mla wrote, replaced whole)",
                      "progress": "no progress bars"})
    return p


def convert_gpt(opts: ToMLAOptions) -> tuple[Any, dict[str, Any], dict]:
    """Load our GPT (a checkpoint or HF GPT-2), calibrate and convert; returns ``(model, report, meta)``
    (``meta``: the source's hparams). ``opts.d_latent``: a whole number here."""
    from kvsplice.convert.mla import (attention_input_grams, insert_kvsplice, kv_relative_error, latent_grams,
                                      mha_to_mla)
    from kvsplice.convert.calib_text import calibration_ids
    from kvsplice.loading import checkpoint_tokenizer, load_model, load_tokenizer
    from kvsplice.lowrank.calibrate import calibration_batches
    from models.checkpoint import load_gpt_checkpoint as load_ckpt
    from models.gpt import GPT

    t0 = time.perf_counter()
    if Path(opts.model).expanduser().is_file():  # our checkpoint: MHA, GQA or (for --kvsplice-keep) MLA
        model, _, meta = load_ckpt(opts.model)
        tokenizer = load_tokenizer(opts.tokenizer) if opts.tokenizer else checkpoint_tokenizer(meta, Path(opts.model))
    else:
        loaded = load_model(opts.model, tokenizer=opts.tokenizer)
        if getattr(loaded.model.config, "model_type", None) != "gpt2":
            raise UsageError(f"--model {opts.model}: a {type(loaded.model).__name__}; to_mla converts our GPT "
                             f"checkpoints, HF GPT-2 and local Llama-family folders / GGUF files")
        model, meta, tokenizer = GPT.from_hf(loaded.model).eval(), {}, loaded.tokenizer
    device, _ = device_dtype(opts)
    model = model.to(device)  # calibration and conversion run there; the checkpoint is saved from CPU copies
    cfg = model.cfg
    if cfg.attention == "mha" and opts.d_latent is None:
        raise UsageError(f"--model is an MHA model ({cfg.variant}): give --d-latent R (1..{cfg.d_model})")
    if cfg.attention == "mla":
        if cfg.kvsplice_keep is not None:
            raise UsageError(f"--model already has KVSplice ({cfg.variant}); convert its MLA parent instead")
        if opts.keep is None:
            raise UsageError("--model is already MLA: give --kvsplice-keep F to insert KVSplice (the kept fraction)")
        if opts.d_latent not in (None, cfg.d_latent):
            raise UsageError(f"--d-latent {opts.d_latent}: the MLA model's latent is {cfg.d_latent} (leave it out)")
    if opts.d_latent is not None and opts.d_latent > cfg.d_model:
        raise UsageError(f"--d-latent {opts.d_latent} is larger than d_model={cfg.d_model}")
    if opts.keep is not None:  # at least one whole latent dimension, checked before calibrating
        from kvsplice.convert.kvsplice_keep import kept_dims

        try:
            kept_dims(opts.keep, opts.d_latent if cfg.attention == "mha" else cfg.d_latent,
                      opts.keep_option)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if opts.keep is not None and opts.kvsplice_init == "pca" and not opts.calib:
        raise UsageError("--kvsplice-init pca needs --calib TEXT (the latents' principal directions), or use "
                         "--kvsplice-init random")
    batches, n_tokens = None, 0
    if opts.calib:
        seq_len = opts.seq_len or default_seq_len(cfg.block_size)
        if seq_len > cfg.block_size:
            raise UsageError(f"--seq-len {seq_len} exceeds the model's block_size {cfg.block_size}")
        ids = calibration_ids(opts.calib, tokenizer, opts.tokens(), seq_len)  # (N·T,)
        batches = calibration_batches(ids, seq_len, opts.batch_size, max_tokens=opts.tokens())
        n_tokens = sum(b.numel() for b in batches)
    report: dict[str, Any] = {"source": str(opts.model), "source_variant": cfg.variant,
                              "source_cache_dim": cfg.cache_dim, "calibration_tokens": n_tokens,
                              "calibration_source": list(opts.calib or [])}
    out = model
    if cfg.attention == "mha":
        grams = attention_input_grams(model, batches, progress=opts.progress)[0] if batches is not None else None
        out = mha_to_mla(model, opts.d_latent, grams)
        report["method"] = "activation-aware" if grams is not None else "weights-only"
        if grams is not None:
            report["kv_relative_error"] = kv_relative_error(model, out, grams)
    if opts.keep is not None:
        lat = latent_grams(out, batches, progress=opts.progress)[0] if opts.kvsplice_init == "pca" else None
        out = insert_kvsplice(out, opts.keep, lat, seed=opts.seed)
        report["kvsplice_init"] = opts.kvsplice_init
    report.update(variant=out.cfg.variant, d_latent=out.cfg.d_latent, cache_dim=out.cfg.cache_dim,
                  compression_vs_source=cfg.cache_dim / out.cfg.cache_dim, seconds=time.perf_counter() - t0)
    return out, report, meta


def _gpt_latent(v: str) -> int:
    try:
        return pos_int(v)
    except (ValueError, argparse.ArgumentTypeError):
        raise UsageError(f"--d-latent {v}: must be >= 1 (the latent size of the GPT model's MLA)") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from models.checkpoint import CheckpointError

    return run_cli(PROG, lambda: _main(argv), (LoadError, CheckpointError))


def _main(argv: Optional[Sequence[str]]) -> int:
    from models.checkpoint import save_model

    opts = from_args(ToMLAOptions, build_parser().parse_args(argv))
    keep_note(opts)
    apply_threads(opts)
    from kvsplice.core.limits import MAX_TEXT_TOKENS, check_count
    from kvsplice.loading import text_tokens

    if opts.calib is not None and len(opts.calib) == 1 and not opts.self_calib:  # bounded by the text's size
        opts = dataclasses.replace(opts, calib_tokens=text_tokens("--calib-tokens", opts.calib_tokens, CALIB_TOKENS,
                                                                  opts.calib[0], text_option="calib"))
    elif opts.calib is not None:  # several sources, or the source's own text (written after the model loads)
        for text in opts.calib_files:
            text_tokens("--calib-tokens", None, CALIB_TOKENS, text, text_option="calib")  # each one readable
        opts = dataclasses.replace(opts, calib_tokens=check_count("--calib-tokens", opts.tokens(),
                                                                  hi=MAX_TEXT_TOKENS))
    from kvsplice.convert.llama_run import is_llama_source, run_llama

    if is_llama_source(opts.model):  # Llama family -> decoupled-RoPE MLA (kvsplice.convert.llama_mla)
        return run_llama(opts)
    for opt in ("rope_dims", "latent_norm", "pad_latent", "pad_rope", "ratio", "rope_layout", "refine_steps"):
        if getattr(opts, opt):
            raise UsageError(f"--{opt.replace('_', '-')} is for Llama-family models; --model {opts.model} is not one")
    if opts.format != "native":
        raise UsageError("--format deepseek_v3 is for Llama-family models (shared RoPE layout)")
    if opts.self_calib:
        raise UsageError(f"--calib self is the source's own text, written by a Llama-family model; --model "
                         f"{opts.model} is not one: give --calib TEXT")
    if opts.d_latent is not None:
        opts = dataclasses.replace(opts, d_latent=_gpt_latent(opts.d_latent))
    out_path, json_path = out_and_json(opts.out, opts.json, force=opts.force,
                                       inputs={"--model": opts.model, "--calib": opts.calib_files,
                                               "--tokenizer": opts.tokenizer})
    model, report, meta = convert_gpt(opts)
    with disk_errors(out_path):  # a full disk: torch.save's own error, one line; atomic_write leaves nothing
        save_model(model, out_path, hparams=meta.get("hparams"), data_hparams=meta.get("data_hparams"),
                   extra={"kvsplice_conversion": {k: v for k, v in report.items() if k != "seconds"}})
    err = report.get("kv_relative_error")
    print(f"{report['source_variant']} ({report['source_cache_dim']} numbers/token/layer) -> {report['variant']} "
          f"({report['cache_dim']}; {report['compression_vs_source']:.2f}x smaller), "
          f"{report.get('method', 'MLA kept')}" + (f", KVSplice init {report['kvsplice_init']}"
                                                    if "kvsplice_init" in report else ""))
    if err:
        print("relative K/V error on the calibration inputs per layer: " + ", ".join(f"{e:.4f}" for e in err))
    print(f"saved {out_path} ({report['seconds']:.1f} s)")
    if json_path is not None:
        with disk_errors(json_path):
            write_json({**report, "out": str(out_path)}, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
