"""Safe checkpoint loading: ``weights_only=True`` everywhere, one clear error for anything else.

A checkpoint written by ``python -m training.fit`` holds only tensors, plain containers and primitives (the model's
hyper-parameters are stored flat, never as a dataclass), so it loads with ``torch.load(..., weights_only=True)``:
PyTorch's restricted unpickler that cannot run code or build arbitrary objects. A file that needs more than that — a
pickled callable such as ``os.system`` or an instance of some class — is refused with :class:`CheckpointError` before
anything in it runs.

* :func:`load_checkpoint` — the raw checkpoint dict.
* :func:`load_gpt_checkpoint` — ``(GPT, GPTConfig, meta)`` rebuilt from a checkpoint's stored config and weights.
* :func:`save_model` — write a GPT (e.g. a converted one, :mod:`kvsplice.to_mla`) in the same format.
* :func:`atomic_write` / :func:`atomic_save` — every file the package writes goes through a temporary sibling
  ``.<name>.<pid>.tmp`` renamed into place; :func:`remove_stale_temp_files` deletes those a killed process left.
* :func:`check_tensor` — a tensor a user handed in (a checkpoint's weight, a bases matrix) is a finite floating
  tensor of the expected shape, or one error line naming the file and the tensor.

:func:`training.checkpoint.safe_checkpoint_io` puts the same loader behind Lightning's checkpoint IO (resumes).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

__all__ = ["CKPT_FORMAT", "CKPT_FORMAT_KEY", "GPT_CONFIG_KEY", "CheckpointError", "atomic_save", "atomic_write",
           "check_tensor", "fsync_dir", "load_checkpoint", "load_gpt_checkpoint", "remove_stale_temp_files",
           "save_model", "temp_path"]

CKPT_FORMAT_KEY = "kvsplice_format"
"""Key of the format version that :class:`training.lit.LitGPT` writes into every checkpoint."""
CKPT_FORMAT = 1
"""Current checkpoint format: ``gpt_config`` (a plain dict of :class:`models.GPTConfig` fields) + ``state_dict`` with
the GPT's weights under the ``model.`` prefix."""
GPT_CONFIG_KEY = "gpt_config"

PathLike = Union[str, "os.PathLike[str]"]
_GLOBAL = re.compile(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) ([\w.]+)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: missing, corrupt, unsafe (pickled code/objects) or from another format/config."""


def _first_line(e: BaseException) -> str:
    """The first sentence of the exception's message (torch's errors run on for several lines)."""
    text = " ".join(str(e).split())
    if not text:
        return type(e).__name__
    return text.split(". ")[0].rstrip(".")


def load_checkpoint(path: PathLike, map_location: Any = "cpu") -> dict:
    """``torch.load(path, map_location, weights_only=True)`` with clear errors.

    Raises:
        CheckpointError: the file does not exist, is not a PyTorch checkpoint (corrupt/truncated), or contains
            pickled code or objects other than tensors, plain containers and primitives ("refusing to load ...").
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file)")
    try:
        obj = torch.load(p, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        text = " ".join(str(e).split())
        found = _GLOBAL.search(text)
        if found is None and not zipfile.is_zipfile(p):  # not even a pickle of globals: random bytes
            raise CheckpointError(
                f"cannot read checkpoint {str(path)!r}: not a valid PyTorch checkpoint (not a torch.save zip file)"
            ) from None
        what = f"it references {found.group(1)}" if found else "it holds data outside the safe subset"
        raise CheckpointError(
            f"refusing to load {str(path)!r}: it contains pickled code or objects that are not plain tensors/"
            f"containers ({what}; checkpoints are loaded with torch.load(weights_only=True) only)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, AttributeError, IndexError,
            TypeError) as e:  # IndexError: a text file read as a pickle
        raise CheckpointError(
            f"cannot read checkpoint {str(path)!r}: not a valid PyTorch checkpoint ({type(e).__name__}: "
            f"{_first_line(e)[:300]})"
        ) from None
    except Exception as e:  # noqa: BLE001 - torch.load hands a safetensors file to safetensors, whose errors differ
        if type(e).__module__.split(".")[0] != "safetensors":
            raise
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: a damaged safetensors file "
                              f"({_first_line(e)[:300]})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} holds a {type(obj).__name__}, expected a dict")
    return obj


def load_gpt_checkpoint(path: PathLike, map_location: Any = "cpu", strict: bool = True):
    """Rebuild the GPT stored in a ``training.fit`` checkpoint.

    Returns:
        ``(model, config, meta)``: the :class:`models.GPT` in eval mode with the checkpoint's weights, its
        :class:`models.GPTConfig`, and ``meta`` — a dict with ``global_step``, ``epoch``, ``hparams`` (the
        LightningModule's flat hyper-parameters), ``data_hparams``, ``variant`` and ``path``.

    Raises:
        CheckpointError: unsafe/corrupt file, a checkpoint of another format or program, or weights that do not
            match the stored config.
    """
    from models.config import GPTConfig
    from models.gpt import GPT  # local: models.gpt imports the cache and attention modules

    ckpt = load_checkpoint(path, map_location=map_location)
    fmt = ckpt.get(CKPT_FORMAT_KEY)
    if fmt is None or GPT_CONFIG_KEY not in ckpt or "state_dict" not in ckpt:
        raise CheckpointError(
            f"{str(path)!r} is not a kvsplice training checkpoint (no {CKPT_FORMAT_KEY!r}/{GPT_CONFIG_KEY!r}/"
            f"'state_dict' entries); expected a file written by python -m training.fit"
        )
    if fmt != CKPT_FORMAT:
        raise CheckpointError(
            f"{str(path)!r} has checkpoint format {fmt!r}, this version reads format {CKPT_FORMAT}"
        )
    try:
        cfg = GPTConfig.from_dict(dict(ckpt[GPT_CONFIG_KEY]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r}: stored model config is not valid for this version: {e}") from None
    prefix = "model."
    if not isinstance(ckpt["state_dict"], dict):
        raise CheckpointError(f"{str(path)!r}: 'state_dict' is a {type(ckpt['state_dict']).__name__}, expected a dict")
    sd = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    model = GPT(cfg)
    expected = model.state_dict()
    for name, value in sd.items():
        want = expected.get(name)
        if want is None:
            continue  # an unexpected key: load_state_dict names it below
        try:
            check_tensor(value, f"{str(path)!r}", f"model.{name}", shape=tuple(want.shape),
                         floating=want.is_floating_point())
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    try:
        model.load_state_dict(sd, strict=strict)
    except RuntimeError as e:
        msg = " ".join(str(e).split())
        raise CheckpointError(
            f"{str(path)!r}: weights do not match the stored config ({cfg.variant}): {msg[:300]}"
        ) from None
    model.eval()
    meta = {
        "path": str(path),
        "global_step": ckpt.get("global_step"),
        "epoch": ckpt.get("epoch"),
        "hparams": dict(ckpt.get("hyper_parameters", {}) or {}),
        "data_hparams": dict(ckpt.get("datamodule_hyper_parameters", {}) or {}),
        "variant": cfg.variant,
        "train_stats": dict(ckpt.get("kvsplice_train_stats", {}) or {}),
    }
    return model, cfg, meta


def check_tensor(t: Any, source: str, name: str, *, shape: Optional[tuple[int, ...]] = None,
                 floating: bool = True) -> torch.Tensor:
    """A tensor read from a user's file: a ``torch.Tensor``, floating point when ``floating`` (never an integer or
    boolean tensor that a copy would silently cast), of ``shape`` when given, with only finite values.

    Raises:
        ValueError: one line naming ``source`` (the file) and ``name`` (the tensor).
    """
    where = f"{source}: tensor {name}"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where} is a {type(t).__name__}, not a tensor")
    if floating and not t.is_floating_point():
        raise ValueError(f"{where} has dtype {str(t.dtype).replace('torch.', '')}, expected a floating-point tensor")
    if not floating and t.is_floating_point():
        raise ValueError(f"{where} has dtype {str(t.dtype).replace('torch.', '')}, expected an integer/bool tensor")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{where} holds {bad} NaN/inf value{'s' if bad != 1 else ''}")
    return t


# ------------------------------------------------------------------------------------------------ atomic writes
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")


def temp_path(path: PathLike, folder: Optional[PathLike] = None) -> Path:
    """``.<name>.<pid>.tmp`` in ``folder`` (default: beside ``path``): where this process writes ``path`` first."""
    path = Path(path)
    return Path(folder if folder is not None else path.parent) / f".{path.name}.{os.getpid()}.tmp"


def _pid_alive(pid: int) -> bool:
    """Whether another live process has this pid (our own pid counts as dead: a container restart reuses pids, and
    this is only called before this process writes)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours (EPERM)
        return True
    return True


def remove_stale_temp_files(folder: PathLike, name: Optional[str] = None) -> list[Path]:
    """Delete the temporaries (``.<name>.<pid>.tmp`` files or folders) that killed writers left in ``folder``, only
    those of ``name`` when given; returns what was removed. A live process's temporaries are left alone. Call it
    before this process writes into ``folder``."""
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for f in folder.iterdir():
        m = _TEMP.match(f.name)
        if not m or (name is not None and m["name"] != name) or _pid_alive(int(m["pid"])):
            continue
        if f.is_dir() and not f.is_symlink():
            shutil.rmtree(f, ignore_errors=True)
        else:
            f.unlink(missing_ok=True)
        removed.append(f)
    return removed


def fsync_dir(folder: Path) -> None:
    """fsync ``folder`` so that a rename inside it is durable (nothing where the platform cannot)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, write: Callable[[Path], None]) -> Path:
    """Write ``path`` atomically: ``write(tmp)`` fills ``.<name>.<pid>.tmp`` beside it, which is fsynced, given the
    usual permissions (``0666`` less the umask) and renamed over ``path`` (``os.replace``).

    Readers see either the old file or the complete new one, never a partial file; an exception leaves nothing
    behind, a kill at most the temporary file (:func:`remove_stale_temp_files`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_save(obj: Any, path: PathLike) -> None:
    """``torch.save(obj, path)`` through :func:`atomic_write`: a resumed run reads the old or the complete new
    checkpoint, never a partial one."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def save_model(model, path: PathLike, *, hparams: dict | None = None, data_hparams: dict | None = None,
               extra: dict | None = None) -> Path:
    """Write ``model`` (a :class:`models.GPT`) as a checkpoint that :func:`load_gpt_checkpoint`, ``training.evaluate`` and
    ``training.fit --model.init_from`` read: format version, ``gpt_config``, ``state_dict`` under ``model.``, the
    LightningModule hyper-parameters (``hparams``, updated with the model's config fields) and the data module's
    (``data_hparams``, so the tokenizer and validation text can be rebuilt). ``extra`` entries are stored as given
    (plain containers only). Written atomically (:func:`atomic_save`)."""
    p = Path(path)
    cfg = model.cfg.to_dict()
    ckpt = {
        CKPT_FORMAT_KEY: CKPT_FORMAT,
        GPT_CONFIG_KEY: cfg,
        "state_dict": {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "hyper_parameters": {**(hparams or {}), **cfg},
        "datamodule_hyper_parameters": dict(data_hparams or {}),
        "global_step": 0,
        "epoch": 0,
        **(extra or {}),
    }
    atomic_save(ckpt, p)
    return p
