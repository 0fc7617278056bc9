"""The model folder of a converted Llama-family MLA model (:class:`models.mla_llama.MLALlama`):
``config.json`` (``model_type: kvsplice_mla_llama`` and the typed config's fields), ``model.safetensors`` (no pickle)
and the source's tokenizer files (``save_pretrained``). ``kvsplice.loading.load_model`` reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from models.compat import current_weight_name
from models.mla_llama import MODEL_TYPE, MLALlama, MLALlamaConfig

__all__ = ["WEIGHTS", "is_mla_folder", "load_mla_folder", "save_mla_folder"]

WEIGHTS = "model.safetensors"


def is_mla_folder(folder: Path) -> bool:
    """``folder/config.json`` names :data:`models.mla_llama.MODEL_TYPE`."""
    try:
        return json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def save_mla_folder(model: MLALlama, folder: Path, tokenizer: Optional[Any] = None) -> None:
    """Write ``model`` (and an HF ``tokenizer``'s files) into ``folder`` (a fresh temporary folder of
    :func:`kvsplice.io.folders.write_dir`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)  # the same tensor as embed.weight
    save_file(sd, str(folder / WEIGHTS), metadata={"format": "pt", "model_type": MODEL_TYPE})
    (folder / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2, default=str) + "\n",
                                        encoding="utf-8")
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))


def load_mla_folder(folder: Path, *, dtype: Optional[torch.dtype] = None) -> MLALlama:
    """The model saved by :func:`save_mla_folder` (weights checked against the config: names, shapes, finite; old
    projection names read through :data:`models.compat.OLD_WEIGHT_NAMES`)."""
    from safetensors.torch import load_file

    from models.checkpoint import check_tensor

    folder = Path(folder)
    cfg = MLALlamaConfig.from_dict(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    model = MLALlama(cfg)
    sd = {current_weight_name(k): v for k, v in load_file(str(folder / WEIGHTS)).items()}
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd.get("embed.weight")
    expect = model.state_dict()
    missing, extra = sorted(set(expect) - set(sd)), sorted(set(sd) - set(expect))
    if missing or extra:
        raise ValueError(f"{folder / WEIGHTS} does not match its config.json (missing {missing[:3]}, unexpected "
                         f"{extra[:3]})")
    for name, t in sd.items():
        if tuple(t.shape) != tuple(expect[name].shape):
            raise ValueError(f"{folder / WEIGHTS}: {name} has shape {tuple(t.shape)}, the config needs "
                             f"{tuple(expect[name].shape)}")
        check_tensor(t, str(folder), name)
    model.load_state_dict(sd)
    return model.to(dtype).eval() if dtype is not None else model.eval()
