"""One exact prefill, many token selections: answer an instance with several methods at the cost of about one.

A token selection's prefill is exact (every prompt query attends over every prompt key) and compresses each layer
from that layer's exact ``q, k, v``; so the prefill of the full cache, with every layer's ``q, k, v`` kept, is the
prefill of *every* selection (any selector, any storage under it, KVzip). :func:`answer_many` runs it once (it is
also the full cache's answer), hands the kept ``q, k, v`` to each selection's ``compress_prefill`` layer by layer
(building exactly the cache the ``Decoder`` would build, without the attention output it already has), then feeds the question and decodes as the ``Decoder`` door does.
Methods that are no selection (int8, KIVI: their prefill attends over their own lossy cache) run the ``Decoder``
door themselves. Same tokens, same bytes as :func:`kvsplice.tasks.runner.answer` (tested); the saving is every
selection's prefill (a 2k-token prefill is most of an instance's time on a CPU).
"""

from __future__ import annotations

import inspect
import time
from typing import Mapping

import torch

from kvsplice.core.method import Step
from kvsplice.decode.decoder import Decoder
from kvsplice.decode.dense import DenseKV
from kvsplice.decode.native import OWN_ATTENTION
from kvsplice.select.method import TokenSelection
from kvsplice.adapters.registry import adapter_for
from kvsplice.tasks.instance import TaskInstance, settled
from kvsplice.tasks.runner import Outcome, _full_fp16, answer, decode_text, greedy, split_prompt

__all__ = ["answer_many"]


class _Keep(DenseKV):
    """The full cache, keeping the prefill's ``q, k, v`` of every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[int, tuple] = {}

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if cache.layer_len(layer) == 0:
            self.kept[layer] = (q, k, v)
        return super().attend(layer, q, k, v, cache, step, mask=mask, logw=logw)


def _finish(dec, cache, logits, rest, n_new, eos, nbytes, seconds, inst, tokenizer, setting, n_prompt,
            n_comp, score_only: bool = False) -> Outcome:
    """Feed the question, decode; ``seconds``: ``(wall, cpu)`` spent on this method before; ``score_only``: stop as
    soon as the score is settled (:func:`~kvsplice.tasks.instance.settled`)."""
    t0, c0 = time.perf_counter(), time.process_time()
    if rest.shape[1]:
        logits = dec(rest, cache, last_only=True)
    done = (lambda toks: settled(decode_text(tokenizer, toks), inst.answers)) if score_only else None
    tokens = greedy(dec, cache, logits, n_new, eos, done)
    if tokens and tokens[-1] == eos:
        tokens = tokens[:-1]
    text = decode_text(tokenizer, tokens)
    return Outcome(inst.key, inst.task, inst.length, setting, "decoder", inst.score(text), text, tokens, n_prompt,
                   n_comp, *nbytes, _full_fp16(dec.adapter, n_comp), seconds[0] + time.perf_counter() - t0,
                   seconds[1] + time.process_time() - c0)


def _takes_shared(f) -> bool:
    try:
        return "shared" in inspect.signature(f).parameters
    except (TypeError, ValueError):
        return False


def _bytes(dec, cache):
    held = dec.held(cache)
    m = dec.method
    return cache.nbytes(), m.bytes_formula(1, held, cache.dtype), m.bytes_formula(1, held, torch.float16)


@torch.no_grad()
def answer_many(model, tokenizer, inst: TaskInstance, factories: Mapping[str, object], *,
                setting: str = "agnostic", score_only: bool = False) -> dict[str, Outcome]:
    """``{name: Outcome}`` for every ``factories[name]`` (``factory(ids[, shared]) -> method | None``) on ``inst``
    in ``setting``, through the ``Decoder`` door, sharing the exact prefill between the full cache and every token
    selection. Each outcome's ``seconds`` is its own work (the shared prefill counted once, in the full cache's).
    ``score_only``: each selection's answer stops once its score is settled (the same scores, shorter outputs:
    the planner's tuning runs; methods that are no selection answer in full)."""
    n_prompt, comp, rest = split_prompt(model, tokenizer, inst, setting)
    n_new, eos, n_comp = inst.max_new_tokens, tokenizer.eos_id, comp.shape[1]
    model.eval()
    a = adapter_for(model)
    if a.name in OWN_ATTENTION or any(a.window(l) for l in range(a.n_layer)):  # its own cache / the Decoder
        # evicts as it goes: no q, k, v to replay
        return {name: answer(model, tokenizer, inst, f, setting=setting) for name, f in factories.items()}
    shared: dict = {}
    methods = {name: f(comp, shared=shared) if _takes_shared(f) else f(comp) for name, f in factories.items()}
    t0, c0 = time.perf_counter(), time.process_time()
    keep = _Keep()
    full = Decoder(model, keep)
    fcache = full.new_cache(1, capacity=comp.shape[1] + rest.shape[1] + n_new)
    logits0 = full(comp, fcache, last_only=True)  # (1, 1, V): exact
    kept = full.method.kept
    full_bytes = _bytes(full, fcache)
    base_s = (time.perf_counter() - t0, time.process_time() - c0)
    out: dict[str, Outcome] = {}
    full_out = None
    for name, method in methods.items():
        if method is None:  # the full cache: the shared prefill's own answer
            if full_out is None:
                full_out = _finish(full, fcache, logits0, rest, n_new, eos, full_bytes, base_s, inst, tokenizer,
                                   setting, n_prompt, n_comp, score_only)
            out[name] = full_out
        elif not isinstance(method, TokenSelection):  # its own prefill (it attends over its lossy cache)
            out[name] = answer(model, tokenizer, inst, lambda ids, m=method: m, setting=setting)
        else:
            t1, c1 = time.perf_counter(), time.process_time()
            dec = Decoder(model, method)
            cache = dec.new_cache(1, capacity=dec.method.capacity(comp.shape[1], rest.shape[1] + n_new))
            step = Step(dec.adapter, 0, comp.shape[1], dec.scales, dec.attn_backend)
            for layer, m in enumerate(dec.layer_methods):  # exactly the Decoder's prefill cache of this method
                m.compress_prefill(layer, *kept[layer], cache, step)  # (its attention output is the full one's)
            out[name] = _finish(dec, cache, logits0, rest, n_new, eos, _bytes(dec, cache),
                                (time.perf_counter() - t1, time.process_time() - c1), inst, tokenizer, setting,
                                n_prompt, n_comp, score_only)
    return out
