"""Export a training checkpoint to the Hugging Face format: ``python -m training.export --ckpt C --out DIR``.

* MHA (``attention="mha"`` with ``n_kv_head`` unset or equal to ``n_head``) → a plain ``GPT2LMHeadModel`` directory
  (``config.json``, ``model.safetensors``, ``generation_config.json``): same weights (Conv1D layout), tied head;
  a model trained with ``bias=False`` gets zero biases (the same function).
* MLA, MLA + KVSplice, and grouped-query MHA (which ``GPT2LMHeadModel`` cannot express) → a directory for
  ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``: ``config.json`` with an ``auto_map``, the
  self-contained ``configuration_kvsplice_gpt.py`` / ``modeling_kvsplice_gpt.py`` (templates in
  :mod:`training.hf_remote`, importing only torch and transformers) and ``model.safetensors``. Its ``generate()``
  caches only the (compressed) latent — K/V of ``n_kv_head`` heads for GQA — and decodes MLA absorbed; KVSplice
  matrices are exported as the trained (materialised) weights; ``latent_norm`` models export their ``kv_norm``.
* The tokenizer the run trained with (rebuilt from the checkpoint's data settings: GPT-2 BPE files or the synthetic
  BPE) is saved as a ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as EOS/BOS/pad; if it cannot be rebuilt
  (data not available here), the export goes on without it and says so.

Weights are read with ``torch.load(weights_only=True)`` (:mod:`training.checkpoint`) and written as safetensors.
An existing non-empty ``--out`` is replaced only with ``--force``. Bad input is one ``export: error: ...`` line,
exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from models.attention import LATENT_NORM_EPS
from models.gpt import HF_CONV1D
from training.checkpoint import CheckpointError, load_model

EXIT_ERROR = 2
REMOTE_DIR = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_kvsplice_gpt.py", "modeling_kvsplice_gpt.py")


class ExportError(RuntimeError):
    """Bad input for the export (one line)."""


def export_kind(cfg) -> str:
    """``"gpt2"`` (plain GPT2LMHeadModel) or ``"remote"`` (trust_remote_code directory)."""
    return "gpt2" if cfg.attention == "mha" and cfg.kv_heads == cfg.n_head else "remote"


# ------------------------------------------------------------------------------------------------- GPT-2
def to_gpt2(model, cfg):
    """Our MHA ``models.GPT`` as a ``transformers.GPT2LMHeadModel`` with the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.d_model,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                        tie_word_embeddings=True)
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


def remote_config(cfg):
    """The remote-code config (``KVSpliceGPTConfig``) of a ``GPTConfig``."""
    Config = _load_template_config()
    out = Config(vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                 block_size=cfg.block_size, bias=cfg.bias, attention=cfg.attention,
                 n_kv_head=cfg.n_kv_head, d_latent=cfg.d_latent, d_compressed=cfg.d_compressed,
                 latent_norm=cfg.latent_norm, latent_norm_eps=LATENT_NORM_EPS,
                 tie_word_embeddings=False)
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


def write_remote(model, cfg, out: Path) -> None:
    from safetensors.torch import save_file

    rc = remote_config(cfg)
    rc.save_pretrained(out)
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_DIR / name, out / name)
    save_file(remote_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------- tokenizer
def save_tokenizer(meta: dict, ckpt: Path, out: Path) -> Optional[dict[str, Any]]:
    """Save the run's tokenizer into ``out``; ``None`` (and a note on stderr) when it cannot be rebuilt here."""
    from transformers import PreTrainedTokenizerFast

    from kvsplice.io.loading import LoadError, checkpoint_tokenizer

    try:
        tok = checkpoint_tokenizer(meta, ckpt).backend  # data.TextTokenizer
    except LoadError as e:
        print(f"export: note: no tokenizer exported ({e})", file=sys.stderr)
        return None
    fast = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eot_token, bos_token=tok.eot_token,
                                   pad_token=tok.eot_token)
    fast.save_pretrained(out)
    return {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}


# ---------------------------------------------------------------------------------------------------- main
def export(ckpt: str | Path, out: str | Path, *, force: bool = False, tokenizer: bool = True) -> dict[str, Any]:
    """Export ``ckpt`` into the directory ``out``; returns a summary (kind, variant, files, cache numbers)."""
    ckpt, out = Path(ckpt), Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} is not empty (use --force to replace its files)")
    try:
        model, cfg, meta = load_model(ckpt)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if cfg.cache_quant:
        print(f"export: note: cache_quant={cfg.cache_quant!r} is a decode option of the package; the exported "
              f"model caches at its dtype", file=sys.stderr)
    kind = export_kind(cfg)
    hf = to_gpt2(model, cfg) if kind == "gpt2" else None  # before touching out: shape errors write nothing
    tmp = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if hf is not None:
            hf.save_pretrained(tmp)
        else:
            write_remote(model, cfg, tmp)
        tok = save_tokenizer(meta, ckpt, tmp) if tokenizer else None
        if tok is not None:
            from transformers import GenerationConfig

            eot = tok["eot_id"]
            GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot).save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"ckpt": str(ckpt), "out": str(out), "kind": "GPT2LMHeadModel" if kind == "gpt2" else "remote-code",
            "variant": cfg.variant, "n_kv_head": cfg.kv_heads, "cache_numbers_per_token_per_layer": cfg.cache_dim,
            "tokenizer": tok, "files": sorted(p.name for p in out.iterdir())}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ExportError(message)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _Parser(prog="python -m training.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint written by python -m training.fit")
    p.add_argument("--out", required=True, help="the output directory")
    p.add_argument("--force", action="store_true", help="replace the files of a non-empty --out")
    p.add_argument("--no-tokenizer", action="store_true", help="do not export the run's tokenizer")
    try:
        args = p.parse_args(argv)
        summary = export(args.ckpt, args.out, force=args.force, tokenizer=not args.no_tokenizer)
    except (ExportError, OSError) as e:
        print(f"export: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
