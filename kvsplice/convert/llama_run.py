"""``kvsplice to-mla`` for a pretrained Llama-family model (Llama, Mistral, Qwen2, Qwen3; an HF folder or a
GGUF file), or for a converted MLA folder (``--kvsplice-keep``): calibrate, convert
(:mod:`kvsplice.convert.llama_mla`), and write a model folder (``--format native``, which every kvsplice command
loads) or a DeepSeek-V3 folder (``--format deepseek_v3``, :mod:`kvsplice.convert.deepseek_v3`). The folder carries
to_mla's marker (:data:`kvsplice.io.marker.MARKER`): ``--force`` replaces only an earlier to_mla folder, whole.
:func:`run_llama` takes the command's options object (:class:`kvsplice.convert.to_mla_options.ToMLAOptions`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional, Union

from kvsplice.convert.to_mla_options import ToMLAOptions
from kvsplice.io.cli import UsageError, default_seq_len, device_dtype

__all__ = ["is_llama_source", "run_llama"]


def is_llama_source(spec: str) -> bool:
    """``spec`` is a local Llama-family model (HF folder of a convertible family or a GGUF file) or a converted MLA
    folder — not a training checkpoint nor GPT-2."""
    from kvsplice.convert.llama_mla import CONVERTIBLE
    from kvsplice.loading.gguf import find_gguf
    from models.mla_llama import MODEL_TYPE

    p = Path(spec).expanduser()
    if find_gguf(p) is not None:
        return True
    if p.is_dir() and (p / "config.json").is_file():
        try:
            mt = json.loads((p / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            return False
        return mt in CONVERTIBLE or mt == MODEL_TYPE
    return False


def _rope_dims(v: Optional[Union[int, str]], layout: str, head_dim: int) -> int:
    """``--rope-dims`` (None: the layout's default) as a count of RoPE dims per RoPE key."""
    if v is None:  # MHA2MLA: 4 of 32 pairs per head; shared: every frequency in the one RoPE key (SmolLM2 at 2x and
        # 4x on the fine-tune text: +68 % / +458 % ppl against +502 % / +801 % with half of them,
        # results/convert_rope_split.md; DeepSeek-V3 itself uses 64 of 192 query dims)
        return max(2, head_dim // 8) if layout == "per-head" else head_dim
    if v == "all":
        return head_dim
    try:
        n = int(v)
    except ValueError:
        raise UsageError(f"--rope-dims {v}: give an even number of dims or 'all'") from None
    if n % 2 or not 2 <= n <= head_dim:
        raise UsageError(f"--rope-dims {v}: must be even and in [2, head_dim={head_dim}], or 'all'")
    return n


def _calibration(opts: ToMLAOptions, model, tokenizer, max_positions):
    """Calibration batches ``(B, T)`` of ``--calib``'s sources (:mod:`kvsplice.convert.calib_text`)."""
    from kvsplice.convert.calib_text import calibration_ids
    from kvsplice.lowrank.calibrate import calibration_batches

    seq_len = opts.seq_len or default_seq_len(max_positions, cap=CALIB_SEQ_LEN)
    if max_positions and seq_len > max_positions:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's {max_positions} positions")
    ids = calibration_ids(opts.calib, tokenizer, opts.tokens(), seq_len, model=model, max_positions=max_positions,
                          progress=opts.progress)  # (N·T,)
    return calibration_batches(ids, seq_len, opts.batch_size, max_tokens=opts.tokens())


CALIB_SEQ_LEN = 2048
"""Default calibration window of the Llama path (at most the model's context): long enough that the distances
attention uses, and what RoPE does over them, are seen (docs/conversion.md)."""

KEEP_WINDOWS = 1
"""Calibration windows whose attention inputs and outputs the conversion keeps (to measure and correct layers on)."""

WRITER = "to_mla"
"""The writer to_mla's folder marker names (:func:`kvsplice.io.folders.output_dir`)."""


def _check_keep(opts: ToMLAOptions, d_latent: int) -> None:
    """``--kvsplice-keep`` keeps at least one whole dimension of the ``d_latent`` latent (before calibrating)."""
    from kvsplice.convert.kvsplice_keep import kept_dims

    try:
        kept_dims(opts.keep, d_latent, opts.keep_option)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run_llama(opts: ToMLAOptions) -> int:
    """Convert ``opts.model`` (a Llama-family source, or a converted folder to shrink or export) and write
    ``opts.out``; returns 0. A bad option or input is a one-line :class:`UsageError`."""
    from kvsplice.convert.llama_mla import (FitOptions, calibrate_layers, convert_llama, full_latent, latent_gram,
                                            refine_layers, shrink_latent)
    from kvsplice.loading import load_model
    from kvsplice.io.files import output_file
    from kvsplice.io.folders import output_dir, write_dir
    from kvsplice.io.write import disk_errors, write_json
    from models.mla_llama import MLALlama

    progress, keep, steps, layout = opts.progress, opts.keep, opts.steps(), opts.layout()
    if opts.ratio is not None:
        for opt, given in (("--d-latent", opts.d_latent), ("--rope-dims", opts.rope_dims)):
            if given is not None:
                raise UsageError(f"--ratio chooses the latent and RoPE widths; leave out {opt} (or --ratio)")
        if opts.rope_layout == "per-head":
            raise UsageError("--ratio converts to the shared RoPE layout (DeepSeek-V3's); leave out --rope-layout")
    inputs = {"--model": opts.model, "--calib": opts.calib_files, "--tokenizer": opts.tokenizer}
    out = output_dir(opts.out, force=opts.force, inputs=inputs, owned=(), writer=WRITER)
    json_path = output_file(opts.json, force=opts.force, option="--json", inputs=inputs,
                            outputs={"--out": out}) if opts.json else None
    t0 = time.perf_counter()
    device, _ = device_dtype(opts)
    loaded = load_model(opts.model, tokenizer=opts.tokenizer, device=device)
    model, tok = loaded.model, loaded.tokenizer
    converted = isinstance(model, MLALlama)
    if converted and opts.ratio is not None:
        raise UsageError(f"--model {opts.model} is already converted: --ratio is for a Llama-family source (shrink a "
                         f"converted latent with --kvsplice-keep)")
    if converted and keep is None and opts.format == "native":
        raise UsageError(f"--model {opts.model} is already a converted MLA model: give --kvsplice-keep to shrink "
                         f"its latent, or --format deepseek_v3 to export it")
    export_only = converted and keep is None
    if (opts.pad_latent is not None or opts.pad_rope is not None) and opts.format != "deepseek_v3":
        raise UsageError("--pad-latent / --pad-rope pad the cache row of a --format deepseek_v3 export")
    if opts.format == "deepseek_v3":  # the bounds before any calibration (the model's own dims: check_pad, below)
        from kvsplice.convert.latent_pad import check_bounds

        try:
            check_bounds(opts.pad_latent, opts.pad_rope)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if opts.latent_norm and opts.format == "deepseek_v3" and not converted:
        raise UsageError("--latent-norm with --format deepseek_v3: a real latent RMSNorm makes a training-free "
                         "conversion unusable (SmolLM2 2x: ppl 1,833 vs 13.2 without it, docs/conversion.md); leave "
                         "--latent-norm out (the export writes the norm in its linear regime, the norm-free model) "
                         "or fine-tune a --latent-norm native folder first")
    if not opts.calib and not export_only:
        raise UsageError("converting a Llama-family model needs --calib TEXT or --calib self (the RoPE split and "
                         "the latent come from calibration activations)")
    if converted and keep is not None:
        _check_keep(opts, model.cfg.d_latent)
    batches = [] if export_only else _calibration(opts, model, tok, loaded.max_positions)
    report: dict[str, Any] = {"source": str(opts.model), "calibration_source": list(opts.calib or []),
                              "calibration_tokens": sum(b.numel() for b in batches)}
    if converted:
        mla = model
        report["source_cache_dim"] = mla.cfg.cache_dim
    else:
        from kvsplice.convert.llama_mla import check_convertible

        try:
            a = check_convertible(model)
        except ValueError as e:
            raise UsageError(f"--model {opts.model}: {e}") from None
        late = keep is not None  # the correction then runs once, on the shrunk latent
        fit = FitOptions(refine_steps=0 if late else steps)
        source = {"path": str(opts.model), "calib": " ".join(opts.calib),
                  "calibration_tokens": report["calibration_tokens"]}
        if opts.ratio is not None:
            mla, stats, report["ratio_candidates"] = _ratio_split(opts, a, batches, fit, progress, source)
            if steps and not late:
                refine_layers(mla, stats, steps, progress=progress)
        else:
            rope_dims = _rope_dims(opts.rope_dims, layout, a.head_dim)
            full = full_latent(a.n_kv_head, a.head_dim, rope_dims, layout, a.d_model)
            r = full if opts.d_latent in (None, "full") else _latent(opts.d_latent, full)
            if keep is not None:
                _check_keep(opts, r)
            stats = calibrate_layers(model, batches, progress=progress, keep_windows=KEEP_WINDOWS)
            mla = convert_llama(model, stats, d_latent=r, rope_dims=rope_dims, layout=layout,
                                latent_norm=opts.latent_norm, fit=fit, progress=progress, source=source)
        report["source_cache_dim"] = 2 * a.n_kv_head * a.head_dim
    if keep is not None:
        try:
            mla = shrink_latent(mla, keep, latent_gram(mla, batches, progress=progress))
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not converted and steps:  # the shrunk latent, corrected against the source layers again
            refine_layers(mla, stats, steps, progress=progress)
    c = mla.cfg
    report.update(rope_layout=c.rope_layout, rope_dims=c.rope_dims, rope_heads=c.rope_heads, d_latent=c.d_latent,
                  latent_norm=c.latent_norm, cache_dim=c.cache_dim, format=opts.format,
                  compression_vs_source=report["source_cache_dim"] / c.cache_dim)
    backend = getattr(tok, "backend", None)
    if opts.format == "deepseek_v3":
        from kvsplice.convert.deepseek_v3 import check_exportable, check_pad, save_deepseek_v3

        try:
            check_exportable(mla)
            check_pad(mla, opts.pad_latent, opts.pad_rope)
        except ValueError as e:
            raise UsageError(str(e)) from None
        write_dir(out, lambda tmp: save_deepseek_v3(mla.cpu(), tmp, backend, pad_latent=opts.pad_latent,
                                                    pad_rope=opts.pad_rope), writer=WRITER)
    else:
        from kvsplice.loading.mla_folder import save_mla_folder

        write_dir(out, lambda tmp: save_mla_folder(mla.cpu(), tmp, backend), writer=WRITER)
    report["seconds"] = time.perf_counter() - t0
    print(f"{report['source_cache_dim']} numbers/token/layer -> {c.cache_dim} (latent {c.d_latent} + "
          f"{c.rope_heads}x{c.rope_dims} RoPE, {c.rope_layout}; {report['compression_vs_source']:.2f}x smaller)"
          + (f", KVSplice {keep}" if keep is not None else ""))
    print(f"saved {out} ({opts.format}, {report['seconds']:.1f} s)")
    if json_path is not None:
        with disk_errors(json_path):
            write_json({**report, "out": str(out)}, json_path)
    return 0


def _latent(v: str, full: int) -> int:
    try:
        n = int(v)
    except ValueError:
        raise UsageError(f"--d-latent {v}: give a number of latent dims or 'full'") from None
    if not 1 <= n <= full:
        raise UsageError(f"--d-latent {v}: must be in [1, {full}] (the rank of the no-RoPE keys and values) or "
                         f"'full'")
    return n


def _ratio_split(opts: ToMLAOptions, a, batches, fit, progress: bool, source: dict):
    """``--ratio``: calibrate, fit each candidate latent / RoPE split (:mod:`kvsplice.convert.cache_split`) and keep
    the measured best: ``(its model, the statistics, the candidates' report)``."""
    from kvsplice.convert.cache_split import choose_split, rope_candidates, split_cache
    from kvsplice.convert.llama_mla import calibrate_layers, full_latent

    cache = split_cache(opts.ratio, a.n_kv_head, a.head_dim)
    try:
        cands = rope_candidates(cache, a.head_dim, lambda dr: full_latent(a.n_kv_head, a.head_dim, dr, "shared",
                                                                          a.d_model), opts.keep)
    except ValueError as e:
        raise UsageError(f"--ratio {opts.ratio:g}: {e}") from None
    stats = calibrate_layers(a.model, batches, progress=progress, keep_windows=KEEP_WINDOWS)
    scored, mla = choose_split(a.model, stats, cands, fit, progress=progress, source=source,
                               latent_norm=opts.latent_norm)
    report = [{"rope_dims": c.rope_dims, "d_latent": c.d_latent, "output_error": c.error} for c in scored]
    return mla, stats, report
