"""One exact prefill, many token selections: answer an instance with several methods at the cost of about one.

The full cache's exact prefill of the instance, every layer's ``q, k, v`` kept, is the prefill of every token
selection (:mod:`kvsplice.select.replay`); :class:`SharedPrefill` keeps it (it is also the full cache's answer),
replays it into each selection's cache, then feeds the question and decodes as the ``Decoder`` door does.
Methods that are no selection (int8, KIVI: their prefill attends over their own lossy cache) run the ``Decoder``
door themselves. Same tokens, same bytes as :func:`kvsplice.tasks.runner.answer` (tested); the saving is every
selection's prefill (a 2k-token prefill is most of an instance's time on a CPU).
"""

from __future__ import annotations

import inspect
import time
from typing import Mapping, Optional

import torch

from kvsplice.decode.decoder import Decoder
from kvsplice.select.replay import can_replay, prefill_kept
from kvsplice.tasks.instance import TaskInstance, settled
from kvsplice.tasks.runner import Outcome, _full_fp16, answer, decode_text, greedy, split_prompt

__all__ = ["SharedPrefill", "answer_many"]


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


class SharedPrefill:
    """One instance's exact prefill, kept: the full cache's answer, and any method's answer built from it
    (:meth:`answer`) as often as asked — a caller that measures methods one after another (the planner's tuning
    tasks) pays the prefill once. ``shared``: the instance's per-context work the methods keep and reuse (KVzip's
    reconstruction scores, :func:`~kvsplice.core.build.per_prompt`). :attr:`nbytes`: what it holds."""

    def __init__(self, model, tokenizer, inst: TaskInstance, *, setting: str = "agnostic",
                 shared: Optional[dict] = None) -> None:
        self.model, self.tokenizer, self.inst, self.setting = model, tokenizer, inst, setting
        self.n_prompt, self.comp, self.rest = split_prompt(model, tokenizer, inst, setting)
        self.shared = {} if shared is None else shared
        model.eval()
        self.replays = can_replay(model)  # else: its own cache, or one the Decoder evicts from as it goes
        self._full: Optional[Outcome] = None
        self.kept = None
        if self.replays:
            t0, c0 = time.perf_counter(), time.process_time()
            n = self.comp.shape[1] + self.rest.shape[1] + inst.max_new_tokens
            self.kept = prefill_kept(model, self.comp, n)
            self._full_bytes = _bytes(self.kept.decoder, self.kept.cache)
            self._base_s = (time.perf_counter() - t0, time.process_time() - c0)

    @property
    def nbytes(self) -> int:
        """Bytes of the kept ``q, k, v`` (and the full cache until its answer is made)."""
        if self.kept is None:
            return 0
        return self.kept.nbytes + (self.kept.cache.nbytes() if self.kept.cache is not None else 0)

    def drop_full_cache(self) -> None:
        """Free the full cache (its answer is not needed: only methods built from the kept prefill)."""
        if self.kept is not None:
            self.kept.cache = None

    @torch.no_grad()
    def full(self, score_only: bool = False) -> Outcome:
        """The full cache's answer (made once: the prefill's own cache; its ``seconds`` include the prefill)."""
        if self._full is None:
            if self.replays and self.kept.cache is None:
                raise ValueError("the full cache was dropped before its answer was made")
            if not self.replays:
                self._full = answer(self.model, self.tokenizer, self.inst, lambda ids: None, setting=self.setting)
            else:
                self._full = _finish(self.kept.decoder, self.kept.cache, self.kept.logits, self.rest,
                                     self.inst.max_new_tokens,
                                     self.tokenizer.eos_id, self._full_bytes, self._base_s, self.inst,
                                     self.tokenizer, self.setting, self.n_prompt, self.comp.shape[1], score_only)
                self.drop_full_cache()  # answered: the kept q, k, v are all later methods need
        return self._full

    @torch.no_grad()
    def answer(self, factory, score_only: bool = False) -> Outcome:
        """The answer of ``factory(ids[, shared])``'s method (``None``: the full cache's): a token selection
        compresses the kept prefill (exactly the ``Decoder``'s prefill cache of it), any other method runs the
        ``Decoder`` door itself (its prefill attends over its own lossy cache)."""
        comp, rest, inst = self.comp, self.rest, self.inst
        method = factory(comp, shared=self.shared) if _takes_shared(factory) else factory(comp)
        if method is None:
            return self.full(score_only)
        if not (self.replays and can_replay(self.model, method)):
            return answer(self.model, self.tokenizer, inst, lambda ids, m=method: m, setting=self.setting)
        t1, c1 = time.perf_counter(), time.process_time()
        dec = Decoder(self.model, method)
        n_new = inst.max_new_tokens
        cache = dec.new_cache(1, capacity=dec.method.capacity(comp.shape[1], rest.shape[1] + n_new))
        self.kept.replay(dec, cache)  # exactly the Decoder's prefill cache of this method
        return _finish(dec, cache, self.kept.logits, rest, n_new, self.tokenizer.eos_id, _bytes(dec, cache),
                       (time.perf_counter() - t1, time.process_time() - c1), inst, self.tokenizer, self.setting,
                       self.n_prompt, comp.shape[1], score_only)


@torch.no_grad()
def answer_many(model, tokenizer, inst: TaskInstance, factories: Mapping[str, object], *,
                setting: str = "agnostic", score_only: bool = False) -> dict[str, Outcome]:
    """``{name: Outcome}`` for every ``factories[name]`` (``factory(ids[, shared]) -> method | None``) on ``inst``
    in ``setting``, through the ``Decoder`` door, sharing the exact prefill between the full cache and every token
    selection (:class:`SharedPrefill`). Each outcome's ``seconds`` is its own work (the shared prefill counted once,
    in the full cache's). ``score_only``: each selection's answer stops once its score is settled (the same scores,
    shorter outputs: the planner's tuning runs; methods that are no selection answer in full)."""
    one = SharedPrefill(model, tokenizer, inst, setting=setting)
    return {name: one.answer(f, score_only) for name, f in factories.items()}
