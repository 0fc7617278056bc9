"""Run a task instance through either door with any method, stack or plan, and score the answer.

::

    out = answer(model, tokenizer, inst, method_for, setting="agnostic", door="decoder")   # or door="hf"
    out.score, out.output, out.cache_bytes

``method_for(ids (1, P)) -> CompressionMethod | None`` builds the method for the ids it will compress (a token
selection keeps a fraction of ``P``; a method that re-reads the context, such as KVzip, takes the ids themselves);
``None`` is the full cache. Greedy decoding, stopped at the tokenizer's end-of-sequence token or after the instance's
``max_new_tokens``:

* **aware** — ``[bos] + context + question`` is prefilled (and compressed), then the answer is generated;
* **agnostic** — ``[bos] + context`` is prefilled and compressed, the question is fed over the compressed cache as one
  chunk, then the answer is generated.

The two doors are the package's :class:`~kvsplice.decode.Decoder` and transformers' ``generate()`` with a
:class:`~kvsplice.hf.KVSpliceHFCache`; they run the same method's ``attend`` and give the same tokens (tested). The
bytes are measured on the cache right after the compressed prefill (the HF door: at the first generated token), beside
the method's closed form at the run's dtype and at fp16 storage (the frontier's unit).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch import nn

from kvsplice.core.method import CompressionMethod
from kvsplice.tasks.instance import SETTINGS, TaskInstance, prompt_ids

__all__ = ["DOORS", "MethodFactory", "Outcome", "answer", "decode_text", "greedy", "split_prompt"]

DOORS = ("decoder", "hf")
MethodFactory = Callable[[torch.Tensor], Optional[CompressionMethod]]


@dataclass
class Outcome:
    """One instance answered: the generated text and tokens, its score and what the cache held."""

    key: str
    task: str
    length: int
    setting: str
    door: str
    score: float
    output: str
    tokens: list
    n_prompt: int  # context + question tokens
    n_compressed: int  # tokens the compressed prefill held before compression
    cache_bytes: int  # measured after the compressed prefill
    formula_bytes: Optional[int]  # the method's closed form for the same tokens
    fp16_bytes: Optional[int]  # the closed form at fp16 storage
    full_fp16_bytes: int  # the full K/V cache of the same tokens at fp16
    seconds: float
    cpu_seconds: float = 0.0  # CPU time of the process (all threads): what the work costs, contention aside

    def to_dict(self) -> dict:
        return asdict(self)


def decode_text(tokenizer, ids: list[int]) -> str:
    """The text of ``ids`` (the tokenizer's own decoder)."""
    return tokenizer.backend.decode(ids)


def _full_fp16(adapter, n_tokens: int) -> int:
    return 2 * adapter.n_layer * adapter.n_kv_head * adapter.head_dim * n_tokens * 2


def _decoder_door(model, method, comp, rest, n_new, eos):
    from kvsplice.decode.decoder import Decoder

    dec = Decoder(model, method)
    m = dec.method
    cache = dec.new_cache(1, capacity=m.capacity(comp.shape[1], rest.shape[1] + n_new))
    logits = dec(comp, cache, last_only=True)  # (1, 1, V): the compressed prefill
    held = dec.held(cache)
    nbytes = (cache.nbytes(), m.bytes_formula(1, held, cache.dtype), m.bytes_formula(1, held, torch.float16))
    if rest.shape[1]:
        logits = dec(rest, cache, last_only=True)  # the question over the compressed cache
    return greedy(dec, cache, logits, n_new, eos), nbytes, dec.adapter


def greedy(dec, cache, logits: torch.Tensor, n_new: int, eos: Optional[int],
           done: Optional[Callable[[list[int]], bool]] = None) -> list[int]:
    """Up to ``n_new`` greedy tokens from the last ``logits (1, T, V)`` on, each fed to ``dec`` over ``cache``; stops
    after ``eos`` (kept), or once ``done(tokens so far)`` is true."""
    out: list[int] = []
    for i in range(n_new):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok == eos or i == n_new - 1 or (done is not None and done(out)):
            break
        logits = dec(torch.tensor([[tok]], device=logits.device), cache, last_only=True)
    return out


class _AfterPrefill:
    """A ``generate()`` streamer that measures the cache when the first new token arrives (after the prefill)."""

    def __init__(self, cache) -> None:
        self.cache, self.calls, self.nbytes = cache, 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.nbytes = _hf_bytes(self.cache)

    def end(self) -> None:
        pass


def _hf_bytes(cache):
    held = cache.held()
    return cache.nbytes(), cache.formula_nbytes(), cache.method.bytes_formula(1, held, torch.float16)


def _hf_door(model, method, comp, rest, n_new, eos):
    from transformers import GenerationConfig

    from kvsplice.decode.dense import DenseKV
    from kvsplice.hf.base import KVSpliceHFCache

    cache = KVSpliceHFCache(model, method or DenseKV())
    ids = torch.cat([comp, rest], dim=1)  # (1, P)
    cfg = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not
                           None else 0)
    streamer = None
    if rest.shape[1]:
        with torch.no_grad():
            model(comp, past_key_values=cache, use_cache=True)  # compressed prefill; generate feeds the rest
        nbytes = _hf_bytes(cache)
    else:
        streamer = _AfterPrefill(cache)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, generation_config=cfg,
                             streamer=streamer)
    if streamer is not None:
        nbytes = streamer.nbytes
    return out[0, ids.shape[1]:].tolist(), nbytes, cache.adapter


def split_prompt(model: nn.Module, tokenizer, inst: TaskInstance, setting: str):
    """``(n_prompt, comp (1, P), rest (1, Q))``: the ids compressed at prefill (context, + the question when
    ``aware``) and those fed after it (the question when ``agnostic``), on the model's device."""
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
    ctx, q = prompt_ids(tokenizer, inst)
    comp_ids, rest_ids = (ctx + q, []) if setting == "aware" else (ctx, q)
    dev = next(model.parameters()).device
    comp = torch.tensor([comp_ids], device=dev)  # (1, P)
    rest = torch.tensor([rest_ids], dtype=torch.long, device=dev).reshape(1, -1)  # (1, Q)
    return len(ctx) + len(q), comp, rest


def answer(model: nn.Module, tokenizer, inst: TaskInstance, method_for: MethodFactory, *, setting: str = "agnostic",
           door: str = "decoder") -> Outcome:
    """Answer ``inst`` with the method ``method_for`` builds, in ``setting`` (:data:`SETTINGS`) through ``door``
    (:data:`DOORS`); greedy."""
    if door not in DOORS:
        raise ValueError(f"door must be one of {DOORS}, got {door!r}")
    n_prompt, comp, rest = split_prompt(model, tokenizer, inst, setting)
    t0, c0 = time.perf_counter(), time.process_time()
    method = method_for(comp)
    run = _decoder_door if door == "decoder" else _hf_door
    was = model.training
    model.eval()
    try:
        tokens, (measured, formula, fp16), adapter = run(model, method, comp, rest, inst.max_new_tokens,
                                                         tokenizer.eos_id)
    finally:
        model.train(was)
    if tokens and tokens[-1] == tokenizer.eos_id:
        tokens = tokens[:-1]
    text = decode_text(tokenizer, tokens)
    return Outcome(inst.key, inst.task, inst.length, setting, door, inst.score(text), text, tokens,
                   n_prompt, comp.shape[1], measured, formula, fp16, _full_fp16(adapter, comp.shape[1]),
                   time.perf_counter() - t0, time.process_time() - c0)
