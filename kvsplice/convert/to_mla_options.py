"""The options of a conversion to MLA (``kvsplice to-mla``) as one typed object: the declaration of the command line
(each field's flag, help and parser: :mod:`kvsplice.io.options`) and what the library takes
(:func:`kvsplice.convert.llama_run.run_llama`), so a library call and the command convert with the same defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

from kvsplice.core.amounts import check_kept_fraction, check_times_smaller, kept_fraction, times_smaller
from kvsplice.core.limits import MAX_TEXT_TOKENS
from kvsplice.io.cli import pos_int
from kvsplice.io.options import Exclusive, opt
from kvsplice.io.run_options import DeviceOption, ForceOption, ProgressOption, ThreadsOption

__all__ = ["CALIB_TOKENS", "MAX_REFINE_STEPS", "OLD_KEEP", "REFINE_STEPS", "SELF_CALIB", "SELF_CALIB_TOKENS",
           "ToMLAOptions"]

CALIB_TOKENS = 65536
"""``--calib-tokens`` when not given."""
SELF_CALIB = "self"
"""``--calib self``: the source's own text (:mod:`kvsplice.loading.self_text`), not a file."""
SELF_CALIB_TOKENS = 16384
"""``--calib-tokens`` when not given with ``--calib self`` (the source writes them: ~40 tokens/s on one CPU core for
a 135M model, once; then read from the cache)."""

REFINE_STEPS = 30
"""Default ``--refine-steps`` with ``--ratio`` (SmolLM2 2×: +9.6 % perplexity instead of +16.2 %, the KL halved;
results/convert_fit.md); 0 otherwise (the closed form, exact at full rank)."""

MAX_REFINE_STEPS = 100000
"""The most ``--refine-steps`` a conversion takes."""

OLD_KEEP = "--kvsplice-ratio"
"""The kept fraction's old spelling, still accepted (with a note): "ratio" means times smaller everywhere else."""

_STEPS = f"must be a whole number of steps in [0, {MAX_REFINE_STEPS}]"


def _steps(s: str) -> int:
    """argparse type: a count of refinement steps in [0, :data:`MAX_REFINE_STEPS`]."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_STEPS}, got {s}") from None
    if not 0 <= v <= MAX_REFINE_STEPS:
        raise argparse.ArgumentTypeError(f"{_STEPS}, got {s}")
    return v


@dataclass(frozen=True, kw_only=True)
class ToMLAOptions(ForceOption, ThreadsOption, ProgressOption, DeviceOption):
    """What ``to-mla`` converts and how: the source ``model`` (our GPT checkpoint, HF GPT-2, a Llama-family folder
    or GGUF file, or a converted MLA folder), the latent (``d_latent``, or ``ratio``: times smaller than the source's
    K/V, the widths measured), the RoPE split (Llama family), KVSplice (``kvsplice_keep``: the kept fraction;
    ``kvsplice_ratio`` its old spelling), the calibration text and the outputs. No ``dtype``: the converted model
    keeps the source's. The fields declare the command line (in this order in ``--help``)."""

    OPTION_GROUPS: ClassVar = (Exclusive(("kvsplice_keep", "kvsplice_ratio")),)  # both spellings: refused

    model: str = opt(help="training .ckpt (MHA, GQA or MLA), an HF GPT-2 directory, a Llama / Mistral / Qwen2 / "
                     "Qwen3 folder or GGUF file, or a converted MLA folder")
    d_latent: Optional[Union[int, str]] = opt(None, help="latent size R of the MLA model (MHA input); Llama family: "
                                              "a number or 'full' (the rank at which the conversion is exact)")
    rope_dims: Optional[Union[int, str]] = opt(None, help="Llama family: RoPE dims per RoPE key (even) or 'all' "
                                               "(default: head_dim/8 per-head; all shared — every frequency in the "
                                               "one RoPE key held best on the fine-tune text, "
                                               "results/convert_rope_split.md)")
    ratio: Optional[float] = opt(None, parse=times_smaller, metavar="N", help="Llama family: a cache N times smaller "
                                 "than the source's K/V at the same dtype (2, 4, 8, ...); the latent and the shared "
                                 "RoPE key's widths are chosen by the measured attention-output error (with "
                                 "--kvsplice-keep: the cache after KVSplice); --d-latent / --rope-dims set them by "
                                 "hand")
    refine_steps: Optional[int] = opt(None, parse=_steps, metavar="N", help="Llama family: Adam steps per layer of "
                                      "the layer-local correction against the source layer's outputs on a "
                                      f"calibration window (default {REFINE_STEPS} with --ratio, else 0: the closed "
                                      "form alone)")
    rope_layout: Optional[str] = opt(None, choices=("per-head", "shared"), help="Llama family: a RoPE key per KV "
                                     "head (MHA2MLA) or one shared per token (TransMLA/DeepSeek; default with "
                                     "--ratio, else per-head)")
    latent_norm: bool = opt(False, help="Llama family: RMSNorm the latent (DeepSeek's kv_a_layernorm; exact at no "
                            "rank, unusable training-free: without it --format deepseek_v3 writes the norm in its "
                            "linear regime, docs/conversion.md)")
    format: str = opt("native", choices=("native", "deepseek_v3"), help="Llama family: the output folder's format "
                      "(native: kvsplice loads it; deepseek_v3: transformers / vLLM / SGLang load it)")
    pad_latent: Optional[int] = opt(None, parse=pos_int, help="--format deepseek_v3: zero-pad the exported latent to "
                                    "this size, exactly (through its RMSNorm), e.g. 512 for vLLM's MLA (latent + "
                                    "RoPE in 320 / 512 / 576; its CPU kernel 512 + 64)")
    pad_rope: Optional[int] = opt(None, parse=pos_int, help="--format deepseek_v3: write the RoPE key with this many "
                                  "dims (a multiple of --rope-dims; its frequencies kept exactly), e.g. 64 for "
                                  "vLLM's CPU MLA")
    kvsplice_keep: Optional[float] = opt(None, parse=kept_fraction, metavar="F", help="insert KVSplice keeping "
                                         "round(R·F) of the latent's R numbers per token (F = 0.5/0.3/0.1 keeps "
                                         "50/30/10 %: KVSplice-50/70/90)")
    kvsplice_ratio: Optional[float] = opt(None, parse=kept_fraction, metavar="F", help="the same as --kvsplice-keep "
                                          "(its old name)")
    kvsplice_init: str = opt("pca", choices=("pca", "random"), help="compress init: top principal directions of the "
                             "calibration latents, or random orthogonal")
    calib: Optional[tuple[str, ...]] = opt(None, metavar="TEXT", help="calibration text (.txt/.json/.jsonl or "
                                           "folder): activation-aware conversion and the KVSplice PCA init; Llama "
                                           "family: 'self' is the source's own text (sampled once across domains and "
                                           "cached, as kvsplice distill's: keeps other prose and retrieval where one "
                                           "domain's text loses them); several: an equal share each, interleaved "
                                           "(e.g. self STORIES; docs/conversion.md)")
    calib_tokens: Optional[int] = opt(None, parse=pos_int, help=f"calibration tokens (default {CALIB_TOKENS}, "
                                      f"{SELF_CALIB_TOKENS} with --calib self, or the whole text if shorter; at most "
                                      f"{MAX_TEXT_TOKENS} and what --calib can give)")
    seq_len: Optional[int] = opt(None, parse=pos_int, help="calibration window (default: the model's context, at "
                                 "most 1024; Llama family: at most 2048)")
    batch_size: int = opt(8, parse=pos_int, help="calibration windows per forward (default 8)")
    seed: int = opt(0, help="seed of a random KVSplice init")
    tokenizer: Optional[str] = opt(None, help="tokenizer files when the model does not bring its own")
    out: str = opt(help="output checkpoint (.ckpt); Llama family: a model folder")
    json: Optional[str] = opt(None, metavar="REPORT.json", help="also write the report as JSON")

    def __post_init__(self) -> None:
        """The values the command line's parsers check, checked for a library call too (one line naming the
        option); one ``calib`` text may be given as a string."""
        if isinstance(self.calib, str):
            object.__setattr__(self, "calib", (self.calib,))
        if self.calib is not None and (not self.calib or len(set(self.calib)) < len(self.calib)):
            raise ValueError(f"--calib {' '.join(self.calib)}: give each text once")
        if self.ratio is not None:
            check_times_smaller("--ratio", self.ratio)
        for option, value in (("--kvsplice-keep", self.kvsplice_keep), (OLD_KEEP, self.kvsplice_ratio)):
            if value is not None:
                check_kept_fraction(option, value)
        if self.kvsplice_keep is not None and self.kvsplice_ratio is not None:
            raise ValueError(f"argument {OLD_KEEP}: not allowed with argument --kvsplice-keep")
        if self.refine_steps is not None and not (isinstance(self.refine_steps, int)
                                                  and 0 <= self.refine_steps <= MAX_REFINE_STEPS):
            raise ValueError(f"--refine-steps {_STEPS}, got {self.refine_steps}")
        for option, value in (("--pad-latent", self.pad_latent), ("--pad-rope", self.pad_rope),
                              ("--calib-tokens", self.calib_tokens), ("--seq-len", self.seq_len),
                              ("--batch-size", self.batch_size), ("--threads", self.threads)):
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{option} must be >= 1, got {value}")
        for option, value, choices in (("--rope-layout", self.rope_layout, (None, "per-head", "shared")),
                                       ("--format", self.format, ("native", "deepseek_v3")),
                                       ("--kvsplice-init", self.kvsplice_init, ("pca", "random"))):
            if value not in choices:
                raise ValueError(f"{option} {value!r}: one of {', '.join(c for c in choices if c)}")

    @property
    def keep(self) -> Optional[float]:
        """The kept fraction of the latent, under either spelling (None: no KVSplice)."""
        return self.kvsplice_keep if self.kvsplice_keep is not None else self.kvsplice_ratio

    @property
    def keep_option(self) -> str:
        """The option the kept fraction was given as (messages name it as the user spelled it)."""
        return OLD_KEEP if self.kvsplice_ratio is not None else "--kvsplice-keep"

    def steps(self) -> int:
        """The refinement steps: ``refine_steps``, else :data:`REFINE_STEPS` with ``ratio``, else 0."""
        if self.refine_steps is not None:
            return self.refine_steps
        return REFINE_STEPS if self.ratio is not None else 0

    def tokens(self) -> int:
        """The calibration tokens: ``calib_tokens``, else :data:`SELF_CALIB_TOKENS` with ``self`` among the sources,
        else :data:`CALIB_TOKENS` (fewer when the text is shorter)."""
        return self.calib_tokens or (SELF_CALIB_TOKENS if self.self_calib else CALIB_TOKENS)

    @property
    def calib_files(self) -> Optional[list[str]]:
        """The calibration sources that are texts (inputs no output may replace; None: none given)."""
        return None if self.calib is None else [c for c in self.calib if c != SELF_CALIB]

    @property
    def self_calib(self) -> bool:
        """``--calib self ...``: the source's own text is one of the calibration sources."""
        return self.calib is not None and SELF_CALIB in self.calib

    def layout(self) -> str:
        """The RoPE layout: ``rope_layout``, else shared with ``ratio`` (DeepSeek-V3's), else per-head."""
        return self.rope_layout or ("shared" if self.ratio is not None else "per-head")
