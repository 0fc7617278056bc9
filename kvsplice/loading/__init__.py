"""Shared loading helpers of the post-training CLIs (``fit_bases``, ``eval_bases``): a model and its tokenizer, and
calibration / evaluation text as one token stream.

Models (:func:`load_model`), by what ``spec`` is:

* a directory with ``config.json`` → ``transformers.AutoModelForCausalLM.from_pretrained`` + ``AutoTokenizer``
  (the families of :data:`kvsplice.adapters.SUPPORTED_FAMILIES`: GPT-2, Llama, Mistral, Qwen2/3, Phi-3, Gemma-3;
  anything else fails with :func:`kvsplice.adapters.model_info`'s one-line "unsupported" error naming them).
  ``python -m kvsplice.convert_llama2c`` makes such a directory from a llama2.c checkpoint (e.g. stories260K);
* a directory whose ``config.json`` has ``model_type: kvsplice_mla_llama`` → a converted Llama-family MLA model
  (:mod:`kvsplice.loading.mla_folder`, made by ``python -m kvsplice.to_mla``) and the tokenizer saved beside it;
* a file (``.ckpt``) → this project's MHA GPT via ``models.checkpoint.load_gpt_checkpoint``; its tokenizer is the one its
  training data used (rebuilt from the checkpoint's data settings with :class:`data.TinyStoriesDataModule`), or
  ``tokenizer=`` (a GPT-2 BPE folder / ``tokenizer.json``, or an HF tokenizer directory);
* a ``.gguf`` file, or a folder holding one and no ``config.json`` → :mod:`kvsplice.loading.gguf` (dequantised to fp32,
  a plain transformers model; needs the ``gguf`` package);
* anything else → a Hugging Face Hub id (the local HF cache first; offline this fails with one line saying to pass
  a local directory).

Text (:func:`iter_texts`): a ``.txt`` file (stories separated by ``<|endoftext|>``, else by blank lines), ``.json``
(``{"texts": [...]}`` or a list), ``.jsonl``, or a folder of those — read with :mod:`data.sources` — or a Hugging
Face dataset id ``ID[:SPLIT]`` (``text`` column). :func:`token_stream` tokenises story by story with the model's
tokenizer and joins them with the tokenizer's document separator (BOS before each story for tokenizers that add
BOS, e.g. Llama / llama2.c; else EOS / ``<|endoftext|>`` after each story, e.g. GPT-2), stopping at ``max_tokens``.

Every failure is a :class:`LoadError` with a one-line message, for the CLIs to print.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from kvsplice.io.cli import first_line

__all__ = ["LoadError", "LoadedModel", "Tokenizer", "checkpoint_tokenizer", "iter_texts", "load_model", "load_tokenizer",
           "token_stream", "first_line"]

CONVERT_HINT = ("pass a local model directory instead, e.g. one made by `python -m kvsplice.convert_llama2c "
                "MODEL.bin --tokenizer TOK.bin --out DIR` or saved with save_pretrained()")


class LoadError(RuntimeError):
    """A model, tokenizer or text cannot be loaded; the message is one line."""


# ================================================================================================ tokenizer
@dataclass
class Tokenizer:
    """The model's tokenizer behind one small interface.

    ``encode(text)`` gives ids without special tokens; :meth:`document` adds the separator: ``bos_id`` before the
    story when ``sep == "bos"``, ``eos_id`` after it when ``sep == "eos"``.
    """

    encode: Callable[[str], list[int]]
    name: str
    vocab_size: int
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    sep: str = "none"  # "bos" | "eos" | "none"
    backend: Any = field(default=None, repr=False)

    def document(self, text: str) -> list[int]:
        ids = self.encode(text)
        if self.sep == "bos":
            return [self.bos_id] + ids
        if self.sep == "eos":
            return ids + [self.eos_id]
        return ids

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "separator": self.sep}


def _from_hf_tokenizer(tok: Any, name: str) -> Tokenizer:
    tok.model_max_length = int(1e30)  # we tokenise whole stories and cut windows ourselves: no length warning
    bos, eos = tok.bos_token_id, tok.eos_token_id
    try:
        probe = tok("a")["input_ids"]
        adds_bos = bos is not None and len(probe) > 0 and probe[0] == bos
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode "a" fails later with a clearer error
        adds_bos = False
    sep = "bos" if adds_bos else ("eos" if eos is not None else ("bos" if bos is not None else "none"))

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    return Tokenizer(encode, name, len(tok), bos, eos, sep, tok)


def _from_text_tokenizer(tok: Any) -> Tokenizer:
    """A :class:`data.TextTokenizer` (GPT-2 BPE or the synthetic BPE): ``<|endoftext|>`` after every story."""
    return Tokenizer(tok.encode, tok.name, tok.vocab_size, None, tok.eot_id, "eos", tok)


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a directory / file: an HF tokenizer directory (``tokenizer_config.json``), a GGUF file (or a
    folder holding one: the tokenizer :func:`load_model` gives with it, without the weights), or GPT-2 BPE files
    (``vocab.json``+``merges.txt``, ``encoder.json``+``vocab.bpe``) / a ``tokenizer.json`` via :mod:`data.tokenizer`."""
    from kvsplice.loading.gguf import find_gguf

    p = Path(spec).expanduser()
    if not p.exists():
        raise LoadError(f"tokenizer path not found: {spec}")
    hf = p.is_dir() and (p / "tokenizer_config.json").is_file()
    gguf = None if hf else find_gguf(p)
    if hf or gguf is not None:
        from transformers import AutoTokenizer

        try:
            tok = (AutoTokenizer.from_pretrained(str(p)) if hf else
                   AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
            return _from_hf_tokenizer(tok, str(p))
        except Exception as e:  # noqa: BLE001
            raise LoadError(f"cannot load the tokenizer in {p}: {first_line(e)}") from None
    from data.errors import DataUnavailableError
    from data.tokenizer import load_bpe_tokenizer as load_bpe

    try:
        return _from_text_tokenizer(load_bpe(p))
    except (DataUnavailableError, ValueError, OSError) as e:
        raise LoadError(f"cannot load a tokenizer from {spec}: {first_line(e)}") from None


def checkpoint_tokenizer(meta: dict, path: Path) -> Tokenizer:
    """The tokenizer a training checkpoint's data module used (its ``data_hparams``)."""
    from data import DataUnavailableError, TinyStoriesDataModule

    hp = dict(meta.get("data_hparams") or {})
    if not hp:
        raise LoadError(f"{path} stores no data settings to rebuild its tokenizer from; pass --tokenizer")
    allowed = set(inspect.signature(TinyStoriesDataModule.__init__).parameters) - {"self"}
    try:
        dm = TinyStoriesDataModule(**{k: v for k, v in hp.items() if k in allowed})
        return _from_text_tokenizer(dm.tokenizer)
    except (DataUnavailableError, ValueError, OSError) as e:
        raise LoadError(f"cannot rebuild the tokenizer of {path} from its data settings ({first_line(e)}); "
                        f"pass --tokenizer") from None




# ================================================================================================ models
@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    kind: str  # "hf-dir" | "hub" | "ckpt" | "gguf" | "mla" (a converted MLA folder)
    source: str
    max_positions: Optional[int]

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "class": type(self.model).__name__,
                "max_positions": self.max_positions, "tokenizer": self.tokenizer.describe()}


def _max_positions(model: nn.Module) -> Optional[int]:
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            return v
    ours = getattr(model, "cfg", None)
    return getattr(ours, "block_size", None)


def _check_supported(model: nn.Module) -> None:
    from kvsplice.adapters import model_info

    try:
        model_info(model)
    except ValueError as e:
        raise LoadError(first_line(e)) from None


def _check_weights(model: nn.Module, source: str) -> None:
    """Every weight of a loaded transformers model is a finite floating-point tensor (a training ``.ckpt`` is
    checked tensor by tensor against its config by :func:`models.checkpoint.load_gpt_checkpoint`)."""
    from models.checkpoint import check_tensor

    for name, p in model.named_parameters():
        try:
            check_tensor(p.detach(), source, name)
        except ValueError as e:
            raise LoadError(str(e)) from None


def _load_hf(name: str, *, local_only: bool, tokenizer: Optional[str], dtype: Optional[torch.dtype]):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvsplice.loading.gguf import refuse_incomplete

    kw: dict[str, Any] = {"local_files_only": local_only, "trust_remote_code": False}  # never run or ask about a
    # repository's own code (transformers would otherwise stop at an interactive [y/N] prompt)
    if dtype is not None:
        kw["dtype"] = dtype
    kw["ignore_mismatched_sizes"] = True  # wrongly shaped weights (a hand-edited config.json) are listed in `info`
    # and refused below in one line, not raised after transformers' multi-line load report
    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar: the CLIs' stderr stays one error line
    hf_logging.set_verbosity_error()  # nor the load report (missing / unexpected / mismatched weights: `info`)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(name, output_loading_info=True, **kw)
        model.eval()
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    try:
        refuse_incomplete(info, name)  # weights transformers would initialise at random
    except ValueError as e:
        raise LoadError(str(e)) from None
    _check_supported(model)
    _check_weights(model, name)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        try:
            tok = _from_hf_tokenizer(AutoTokenizer.from_pretrained(name, local_files_only=local_only,
                                                                   trust_remote_code=False), name)
        except Exception as e:  # noqa: BLE001
            raise LoadError(f"{name}: the model loaded but its tokenizer did not ({first_line(e)}); pass "
                            f"--tokenizer") from None
    return model, tok


def _load_gguf(p: Path, *, tokenizer: Optional[str], dtype: Optional[torch.dtype]):
    from kvsplice.loading.gguf import load_gguf

    try:
        model, hf_tok = load_gguf(p, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - a missing gguf package, a corrupt or unsupported file
        raise LoadError(f"cannot load the GGUF model {p}: {first_line(e)}") from None
    _check_supported(model)
    _check_weights(model, str(p))
    tok = load_tokenizer(tokenizer) if tokenizer is not None else _from_hf_tokenizer(hf_tok, str(p))
    return model, tok


def _load_mla(p: Path, *, tokenizer: Optional[str], dtype: Optional[torch.dtype]):
    from kvsplice.loading.mla_folder import load_mla_folder

    try:
        model = load_mla_folder(p, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - a corrupt folder: missing or mismatched weights, bad config
        raise LoadError(f"cannot load the converted MLA model in {p}: {first_line(e)}") from None
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # AutoTokenizer reads config.json and warns about the unknown model_type
    try:
        return model, load_tokenizer(tokenizer if tokenizer is not None else p)
    finally:
        hf_logging.set_verbosity(level)


def _refuse_remote_code(folder: Path) -> None:
    """A model folder whose ``config.json`` maps to its own Python code (``auto_map``, e.g. a ``training.export`` of
    an MLA model) is refused with one line: the tools never run a repository's code."""
    import json

    try:
        auto_map = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("auto_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise LoadError(f"{folder}/config.json is not a JSON object ({first_line(e)})") from None
    if auto_map:
        raise LoadError(f"{folder} holds custom model code (config.json auto_map), which the kvsplice tools do not "
                        f"run; pass the training .ckpt it was exported from, or load it yourself with "
                        f"AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)")


def load_model(spec: str | os.PathLike, *, tokenizer: Optional[str] = None, dtype: Optional[torch.dtype] = None,
               device: str | torch.device = "cpu") -> LoadedModel:
    """Load ``spec`` (a model directory, a ``.ckpt`` file or a Hub id; see the module docstring) in eval mode."""
    spec = str(spec)
    p = Path(spec).expanduser()
    from kvsplice.loading.checks import check_source
    from kvsplice.loading.gguf import find_gguf, gguf_files

    check_source(p)  # config values against the weights' headers, before any model is built

    if find_gguf(p) is not None:  # a .gguf file (or a folder holding one): kvsplice.loading.gguf
        model, tok = _load_gguf(p, tokenizer=tokenizer, dtype=dtype)
        kind = "gguf"
    elif p.is_dir():
        several = gguf_files(p)
        if not (p / "config.json").is_file() and len(several) > 1:
            raise LoadError(f"{spec} holds {len(several)} GGUF files ({', '.join(f.name for f in several[:3])}"
                            f"{', ...' if len(several) > 3 else ''}): pass the one to load, e.g. --model "
                            f"{several[0]}")
        if not (p / "config.json").is_file():
            raise LoadError(f"{spec} is a directory without config.json: not a transformers model directory "
                            f"(e.g. make one with python -m kvsplice.convert_llama2c)")
        _refuse_remote_code(p)
        from kvsplice.loading.mla_folder import is_mla_folder

        if is_mla_folder(p):  # a converted Llama-family MLA model (python -m kvsplice.to_mla)
            model, tok = _load_mla(p, tokenizer=tokenizer, dtype=dtype)
            kind = "mla"
        else:
            try:
                model, tok = _load_hf(str(p), local_only=True, tokenizer=tokenizer, dtype=dtype)
            except LoadError:
                raise
            except Exception as e:  # noqa: BLE001 - unknown model types, corrupt weights, ...
                raise LoadError(f"cannot load the model in {spec}: {first_line(e)}") from None
            kind = "hf-dir"
    elif p.is_file():
        from models.checkpoint import CheckpointError, load_gpt_checkpoint

        try:
            model, _, meta = load_gpt_checkpoint(p)
        except CheckpointError as e:
            raise LoadError(first_line(e)) from None
        _check_supported(model)
        tok = load_tokenizer(tokenizer) if tokenizer is not None else checkpoint_tokenizer(meta, p)
        if dtype is not None:
            model = model.to(dtype)
        kind = "ckpt"
    else:
        looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith((".ckpt", ".pt", ".bin", ".safetensors")) \
            or spec.count("/") > 1 or os.sep != "/" and os.sep in spec
        if looks_like_path:
            raise LoadError(f"model not found: {spec} (expected a model directory with config.json, a .ckpt "
                            f"checkpoint or a Hugging Face Hub id)")
        model = None
        try:  # the local HF cache first: works offline when the model was downloaded before
            model, tok = _load_hf(spec, local_only=True, tokenizer=tokenizer, dtype=dtype)
        except LoadError:
            raise
        except Exception:  # noqa: BLE001
            pass
        if model is None:
            from data.errors import hub_offline_reason

            reason = hub_offline_reason()
            if reason is not None:
                raise LoadError(f"cannot download {spec!r} from the Hugging Face Hub ({reason}) and it is not a "
                                f"local path; {CONVERT_HINT}")
            try:
                model, tok = _load_hf(spec, local_only=False, tokenizer=tokenizer, dtype=dtype)
            except LoadError:
                raise
            except Exception as e:  # noqa: BLE001
                raise LoadError(f"cannot load {spec!r} from the Hugging Face Hub ({first_line(e, 200)}); "
                                f"{CONVERT_HINT}") from None
        kind = "hub"
    model = model.to(device).eval()
    if tok.vocab_size > _vocab(model):
        raise LoadError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has only "
                        f"{_vocab(model)}: wrong --tokenizer?")
    return LoadedModel(model, tok, kind, spec, _max_positions(model))


def _vocab(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.transformer.wte
    return int(emb.weight.shape[0])


# ================================================================================================ text
def iter_texts(spec: str | os.PathLike, *, option: str = "data", split: str = "train") -> Iterator[str]:
    """Stories from a local file / folder (``.txt``/``.json``/``.jsonl``) or a Hugging Face dataset ``ID[:SPLIT]``.

    The source is checked before the first story is yielded (errors are raised by the first ``next()``)."""
    spec = str(spec)
    p = Path(spec).expanduser()
    if p.exists() or spec.startswith((".", "/", "~")) or p.suffix.lower() in (".txt", ".json", ".jsonl"):
        from data.errors import DataUnavailableError
        from data.sources import iter_stories_from_file, list_story_files

        if not p.exists():
            raise LoadError(f"--{option} {spec}: file not found")
        try:
            files = list_story_files(p, option=option)  # checks each file: binary / empty text is refused here
        except DataUnavailableError as e:
            raise LoadError(first_line(e)) from None

        def gen() -> Iterator[str]:
            try:
                for f in files:
                    yield from iter_stories_from_file(f)
            except (DataUnavailableError, UnicodeDecodeError, ValueError) as e:
                raise LoadError(f"--{option} {spec}: {first_line(e)}") from None

        return gen()
    return _iter_hf_dataset(spec, option=option, split=split)


def _iter_hf_dataset(spec: str, *, option: str, split: str) -> Iterator[str]:
    name, _, sp = spec.partition(":")
    sp = sp or split
    try:
        import datasets
    except ImportError:
        raise LoadError(f"--{option} {spec}: not a local file, and the `datasets` package is not installed") from None
    from data.errors import hub_offline_reason

    reason = hub_offline_reason()
    if reason is not None and "OFFLINE=" not in reason:  # unreachable: fail now instead of retrying for ~30 s
        raise LoadError(f"--{option} {spec}: not a local file, and Hugging Face dataset {name!r} cannot be "
                        f"downloaded ({reason}); pass a local .txt/.json file")
    try:  # reachable, or offline mode (HF_*_OFFLINE=1): the local datasets cache may have it
        ds = datasets.load_dataset(name, split=sp, streaming=not reason)
    except Exception as e:  # noqa: BLE001
        why = reason if reason is not None else first_line(e, 200)
        raise LoadError(f"--{option} {spec}: not a local file, and Hugging Face dataset {name!r} (split {sp!r}) "
                        f"cannot be loaded ({why}); pass a local .txt/.json file") from None

    def gen() -> Iterator[str]:
        for row in ds:
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise LoadError(f"--{option} {spec}: rows have no 'text' column (got {sorted(row)[:5]})")
            if text.strip():
                yield text.strip()

    return gen()


def token_stream(texts: Iterable[str], tokenizer: Tokenizer, max_tokens: Optional[int] = None, *,
                 progress: bool = False, desc: str = "tokenize") -> tuple[torch.Tensor, int]:
    """Tokenise ``texts`` story by story (each with the tokenizer's separator) into one 1-D LongTensor, stopping
    once ``max_tokens`` tokens are collected (the tensor is cut to exactly ``max_tokens`` if that many exist).
    Returns ``(ids, n_stories)``."""
    from tqdm.auto import tqdm

    ids: list[int] = []
    n = 0
    with tqdm(total=max_tokens, desc=desc, unit="tok", disable=not progress, leave=False) as bar:
        for text in texts:
            doc = tokenizer.document(text)
            ids.extend(doc)
            n += 1
            bar.update(len(doc) if max_tokens is None else min(len(doc), max(max_tokens - bar.n, 0)))
            if max_tokens is not None and len(ids) >= max_tokens:
                break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long), n
