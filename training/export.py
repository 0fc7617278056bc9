"""Export a training checkpoint to the Hugging Face format: ``kvsplice export --ckpt C --out DIR``.

* MHA (``attention="mha"`` with ``n_kv_head`` unset or equal to ``n_head``) → a plain ``GPT2LMHeadModel`` directory
  (``config.json``, ``model.safetensors``, ``generation_config.json``): same weights (Conv1D layout), tied head;
  a model trained with ``bias=False`` gets zero biases (the same function).
* MLA, MLA + KVSplice, and grouped-query MHA (which ``GPT2LMHeadModel`` cannot express) → a directory for
  ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``: ``config.json`` with an ``auto_map``, the
  self-contained ``configuration_kvsplice_gpt.py`` / ``modeling_kvsplice_gpt.py`` (templates in
  :mod:`training.hf_remote`, importing only torch and transformers) and ``model.safetensors``. Its ``generate()``
  caches only the (compressed) latent — K/V of ``n_kv_head`` heads for GQA — and decodes MLA absorbed; KVSplice
  matrices are exported as the trained (materialised) weights; ``latent_norm`` models export their ``kv_norm``.
* ``layout="deepseek_v3"`` models (docs/deepseek_layout.md) → folders plain ``transformers`` loads without remote
  code (:mod:`kvsplice.convert.gpt_deepseek`): MLA and MLA + KVSplice as DeepSeek-V3 (``--format deepseek_v3``;
  KVSplice-r folded into an MLA with ``kv_lora_rank = r``), standard attention as a Llama (``--format llama``).
  ``--format auto`` (default) picks by layout and attention; a format the model cannot take is one line.
  ``--pad-latent P`` / ``--pad-rope D`` write the DeepSeek-V3 latent / RoPE key zero-padded to ``kv_lora_rank = P`` /
  ``qk_rope_head_dim = D``, exactly (:mod:`kvsplice.convert.latent_pad`) — ``--pad-latent 512 --pad-rope 64`` is the
  one row vLLM's CPU MLA kernel takes.
* The tokenizer the run trained with (rebuilt from the checkpoint's data settings: GPT-2 BPE files or the synthetic
  BPE) is saved as a ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as EOS/BOS/pad; if it cannot be rebuilt
  (data not available here), the export goes on without it and says so.

Weights are read with ``torch.load(weights_only=True)`` (:mod:`training.checkpoint`; every tensor checked: finite,
floating point, the shapes of the stored config) and written as safetensors. The files are written into a temporary
folder and moved into ``--out`` (:mod:`kvsplice.io.folders`) with the marker that says export wrote it
(:data:`kvsplice.io.marker.MARKER`): a non-empty ``--out`` is replaced only with ``--force`` and only when its
marker says an earlier export wrote it and it holds nothing else — never a folder another tool wrote (even with the
same file names), a folder with other files (a run folder, ``.``, ``some/dir/..``) or the folder of ``--ckpt``; the
earlier export is then replaced whole. Bad input (a read-only or full disk, a pad beyond
:data:`kvsplice.convert.latent_pad.MAX_PAD_LATENT`, a damaged checkpoint) is one ``kvsplice export: error: ...``
line, exit status 2, nothing written.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice export"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from kvsplice.convert import deepseek_v3, gpt_deepseek
from kvsplice.convert.latent_pad import padded_row
from kvsplice.io.cli import Parser, run_cli
from kvsplice.io.options import add_options, from_args, opt
from kvsplice.io.run_options import ForceOption
from kvsplice.io.claims import release_claim
from kvsplice.io.folders import output_dir, write_dir
from kvsplice.io.marker import MARKER
from models.latent_attention import LATENT_NORM_EPS
from models.config import DEEPSEEK_V3
from models.gpt import HF_CONV1D
from training.checkpoint import CheckpointError

REMOTE_DIR = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_kvsplice_gpt.py", "modeling_kvsplice_gpt.py")
EXPORT_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json", "special_tokens_map.json", MARKER, *REMOTE_FILES})
"""Every file an export may write (its marker included)."""
WRITER = "export"
"""The writer an export's marker names (:func:`kvsplice.io.folders.output_dir`)."""


FORMATS = ("auto", "gpt2", "remote", "deepseek_v3", "llama")
"""``--format``: ``auto`` or one export kind (:func:`export_kind`)."""
KIND_NAMES = {"gpt2": "GPT2LMHeadModel", "remote": "remote-code", "deepseek_v3": "DeepseekV3ForCausalLM",
              "llama": "LlamaForCausalLM"}


class ExportError(RuntimeError):
    """Bad input for the export (one line)."""


def export_kind(cfg, fmt: str = "auto") -> str:
    """``"gpt2"`` (plain GPT2LMHeadModel), ``"remote"`` (trust_remote_code directory), ``"deepseek_v3"`` or
    ``"llama"`` (deepseek_v3 layout); ``fmt`` other than ``auto`` must be one the model can take."""
    if cfg.layout == DEEPSEEK_V3:
        kind = "deepseek_v3" if cfg.attention == "mla" else "llama"
    else:
        kind = "gpt2" if cfg.attention == "mha" and cfg.kv_heads == cfg.n_head else "remote"
    if fmt not in ("auto", kind):
        raise ExportError(f"--format {fmt} cannot express this {cfg.variant} model (layout={cfg.layout}); use "
                          f"--format {kind} (or auto)")
    return kind


# ------------------------------------------------------------------------------------------------- GPT-2
def to_gpt2(model, cfg, eot_id: Optional[int] = None):
    """Our MHA ``models.GPT`` as a ``transformers.GPT2LMHeadModel`` with the same weights; its BOS/EOS id is the
    run's end-of-text token ``eot_id`` (``None`` when unknown: never GPT-2's 50256 for another vocabulary)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.d_model,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                        tie_word_embeddings=True, bos_token_id=eot_id, eos_token_id=eot_id)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    ours = model.state_dict()
    sd = {}
    for name, target in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        if name in ours:
            w = ours[name]
            w = w.t() if name.endswith(HF_CONV1D) else w  # nn.Linear (out, in) → Conv1D (in, out)
        elif name.endswith(".bias"):
            w = torch.zeros_like(target)  # bias=False model: zero biases compute the same function
        else:
            raise ExportError(f"the checkpoint has no weight for GPT-2's {name}")
        if tuple(w.shape) != tuple(target.shape):
            raise ExportError(f"{name}: shape {tuple(w.shape)} does not fit GPT-2's {tuple(target.shape)}")
        sd[name] = w.detach().to(target.dtype).clone()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ExportError(f"GPT-2 weights do not match: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


# ------------------------------------------------------------------------------------------------ remote
def _load_template_config():
    import importlib.util

    spec = importlib.util.spec_from_file_location("configuration_kvsplice_gpt", REMOTE_DIR / REMOTE_FILES[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.KVSpliceGPTConfig


def remote_config(cfg, eot_id: Optional[int] = None):
    """The remote-code config (``KVSpliceGPTConfig``) of a ``GPTConfig``, BOS/EOS = ``eot_id``."""
    Config = _load_template_config()
    out = Config(vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                 block_size=cfg.block_size, bias=cfg.bias, attention=cfg.attention,
                 n_kv_head=cfg.n_kv_head, d_latent=cfg.d_latent, d_compressed=cfg.d_compressed,
                 latent_norm=cfg.latent_norm, latent_norm_eps=LATENT_NORM_EPS,
                 tie_word_embeddings=False, bos_token_id=eot_id, eos_token_id=eot_id)
    out.architectures = ["KVSpliceGPTForCausalLM"]
    out.auto_map = {"AutoConfig": "configuration_kvsplice_gpt.KVSpliceGPTConfig",
                    "AutoModelForCausalLM": "modeling_kvsplice_gpt.KVSpliceGPTForCausalLM"}
    return out


def remote_state_dict(model) -> dict[str, torch.Tensor]:
    """Our weights under the remote model's names: KVSplice matrices materialised (orthogonal parametrisations
    evaluated), ``lm_head.weight`` stored on its own (the remote model does not tie)."""
    sd = {k: v for k, v in model.state_dict().items() if ".parametrizations." not in k}
    for i, block in enumerate(model.transformer.h):
        splice = getattr(block.attn, "splice", None)
        if splice is not None:
            sd[f"transformer.h.{i}.attn.splice.compress.weight"] = splice.compress_weight()
            sd[f"transformer.h.{i}.attn.splice.expand.weight"] = splice.expand_weight()
    sd["lm_head.weight"] = model.lm_head.weight
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def write_remote(model, cfg, out: Path, eot_id: Optional[int] = None) -> None:
    from safetensors.torch import save_file

    rc = remote_config(cfg, eot_id)
    rc.save_pretrained(out)
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_DIR / name, out / name)
    save_file(remote_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------- tokenizer
def run_tokenizer(meta: dict, ckpt: Path):
    """The run's tokenizer (a :class:`data.TextTokenizer`), or ``None`` (and a note on stderr) when it cannot be
    rebuilt here."""
    from kvsplice.loading import LoadError, checkpoint_tokenizer

    try:
        return checkpoint_tokenizer(meta, ckpt).backend
    except LoadError as e:
        print(f"export: note: no tokenizer exported ({e})", file=sys.stderr)
        return None


def save_tokenizer(tok, out: Path) -> None:
    """Save ``tok`` as a ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as EOS/BOS/pad, and the matching
    ``generation_config.json``, into ``out``."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eot_token, bos_token=tok.eot_token,
                                   pad_token=tok.eot_token)
    fast.save_pretrained(out)
    eot = tok.eot_id
    GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot).save_pretrained(out)


# ---------------------------------------------------------------------------------------------------- main
def export(ckpt: str | Path, out: str | Path, *, force: bool = False, tokenizer: bool = True,
           fmt: str = "auto", pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> dict[str, Any]:
    """Export ``ckpt`` into the directory ``out`` in format ``fmt`` (:data:`FORMATS`); returns a summary (kind,
    variant, files, cache numbers). ``pad_latent`` / ``pad_rope``: the DeepSeek-V3 export's ``kv_lora_rank`` /
    ``qk_rope_head_dim`` (padded, exact).

    Raises:
        kvsplice.io.cli.UsageError: ``out`` is refused (see the module docstring).
        ExportError: the checkpoint cannot be loaded or exported.
    """
    out = output_dir(out, force=force, inputs={"--ckpt": ckpt}, owned=EXPORT_FILES, writer=WRITER)
    try:
        return _export(Path(ckpt), out, tokenizer, fmt, pad_latent, pad_rope)
    finally:
        release_claim(out)  # a library call leaves no .claim file beside its output


def _export(ckpt: Path, out: Path, tokenizer: bool, fmt: str = "auto",
            pad_latent: Optional[int] = None, pad_rope: Optional[int] = None) -> dict[str, Any]:
    from models.checkpoint import load_gpt_checkpoint

    try:
        model, cfg, meta = load_gpt_checkpoint(ckpt)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if cfg.cache_quant:
        print(f"export: note: cache_quant={cfg.cache_quant!r} is a decode option of the package; the exported "
              f"model caches at its dtype", file=sys.stderr)
    kind = export_kind(cfg, fmt)
    if (pad_latent, pad_rope) != (None, None):
        if kind != "deepseek_v3":
            raise ExportError(f"--pad-latent / --pad-rope pad a DeepSeek-V3 export's cache row; this {cfg.variant} "
                              f"model exports as {KIND_NAMES[kind]}")
        try:
            padded_row(cfg.d_cached_latent, cfg.qk_rope_head_dim, pad_latent, pad_rope)
        except ValueError as e:
            raise ExportError(str(e)) from None
    tok = run_tokenizer(meta, ckpt) if tokenizer else None
    eot = tok.eot_id if tok is not None and 0 <= tok.eot_id < cfg.vocab_size else None
    # before touching out: shape errors write nothing
    hf = to_gpt2(model, cfg, eot) if kind == "gpt2" else gpt_deepseek.llama_model(model, eot) if kind == "llama" \
        else None

    def fill(tmp: Path) -> None:
        if hf is not None:
            hf.save_pretrained(tmp)
        elif kind == "deepseek_v3":
            deepseek_v3.save_deepseek_v3(model, tmp, pad_latent=pad_latent, pad_rope=pad_rope)
        else:
            write_remote(model, cfg, tmp, eot)
        if tok is not None:
            save_tokenizer(tok, tmp)

    files = write_dir(out, fill, owned=EXPORT_FILES, writer=WRITER)
    return {"ckpt": str(ckpt), "out": str(out), "kind": KIND_NAMES[kind],
            "variant": cfg.variant, "n_kv_head": cfg.kv_heads, "cache_numbers_per_token_per_layer": cfg.cache_dim,
            "tokenizer": None if tok is None else {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "files": files}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv), (ExportError,))


@dataclass(frozen=True)
class ExportOptions(ForceOption):
    """``kvsplice export``'s options, declared once (the parser is built from them; :func:`export_run` takes
    them)."""

    ckpt: str = opt(help="a checkpoint written by kvsplice train")
    out: str = opt(help="the output directory (new or empty; --force: an earlier export)")
    tokenizer: bool = opt(True, flags=("--no-tokenizer",), help="do not export the run's tokenizer")
    format: str = opt("auto", choices=FORMATS, help="auto (default): GPT-2 layout MHA -> gpt2, its MLA / KVSplice / "
                      "GQA -> remote; deepseek_v3 layout MLA / KVSplice -> deepseek_v3, its standard attention -> llama")
    pad_latent: Optional[int] = opt(None, parse=int, metavar="P", help="deepseek_v3: write kv_lora_rank = P, the "
                                    "latent zero-padded exactly (512 for vLLM's CPU MLA kernel)")
    pad_rope: Optional[int] = opt(None, parse=int, metavar="D", help="deepseek_v3: write qk_rope_head_dim = D (a "
                                  "multiple of the RoPE key), its frequencies kept exactly (64 for vLLM's CPU MLA "
                                  "kernel)")


def export_run(opts: ExportOptions) -> dict[str, Any]:
    """:func:`export` with the command's options."""
    return export(opts.ckpt, opts.out, force=opts.force, tokenizer=opts.tokenizer, fmt=opts.format,
                  pad_latent=opts.pad_latent, pad_rope=opts.pad_rope)


def build_parser() -> Parser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_options(p, ExportOptions, help={"force": "replace an earlier export in --out whole (a folder another tool "
                                                 "wrote or holding any other file is refused)"})
    return p


def _main(argv: Optional[Sequence[str]]) -> int:
    summary = export_run(from_args(ExportOptions, build_parser().parse_args(argv)))
    print(json.dumps(summary, indent=2))
    return 0

if __name__ == "__main__":
    sys.exit(main())
