"""The planner's default pick prefers a fast prefill (:data:`kvsplice.planning.search.PREFILL`): with tuning tasks,
the fast-prefill selectors are tried first and, when one holds the tuning tasks, the pick is among them and the
slow ones (every query voting, KVzip's exact reconstruction pass) are never run; when none holds, every selector is
tried and the objective decides. On a tiny Llama, with task scores drawn per candidate label."""

from __future__ import annotations

import pytest
import torch

from tiny_models import tiny_family

import kvsplice.planning.search as search_mod
from kvsplice.adapters import adapter_for
from kvsplice.evaluation.protocol import full_bytes_per_token
from kvsplice.planning.search import DEFAULT_SELECTORS, SearchOptions, fast_prefill, search

SLOW = "observed_attention"  # every query votes: the prefill's attention again
FAST = ("snapkv", "observed_attention(stride=8)")


class _Bench:
    """Tuning instances whose score depends only on the candidate's label: ``answers(label) -> bool``."""

    def __init__(self, answers, n: int = 4):
        self.answers, self.n, self.labels = answers, n, []

    def full(self) -> float:
        return 100.0

    def scores(self, factory, label):
        self.labels.append(label)
        for _ in range(self.n):
            yield float(self.answers(label))


def _slow(label: str) -> bool:
    return label.startswith(SLOW + "×")


@pytest.fixture(scope="module")
def setup():
    model = tiny_family("llama", n_layer=2)
    windows = torch.randint(3, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    return model, windows, full_bytes_per_token(adapter_for(model)) / 3


def _search(setup, bench, **kw):
    model, windows, budget = setup
    opts = SearchOptions(prompt_len=32, budget=budget, selectors=(*FAST, SLOW), lowrank_ratios=(),
                         objective="mixed", **kw)
    return search(model, None, windows, opts, task_eval=bench)


def test_a_fast_selector_that_holds_the_tasks_is_picked_and_the_slow_ones_never_run(setup, monkeypatch):
    monkeypatch.setattr(search_mod, "EXHAUSTIVE_TASKS", True)
    bench = _Bench(lambda label: True)  # everything answers: the fast forms hold the tuning tasks
    found = _search(setup, bench)
    labels = [c["label"] for c in found["candidates"]]
    assert found["selector"] in FAST and found["selectors_left_out"] == [SLOW]
    assert not any(_slow(label) for label in labels + bench.labels)  # never measured, never asked
    assert not _slow(found["chosen"]["label"]) and found["chosen"]["task_acc"] == 100.0


def test_when_no_fast_selector_holds_the_tasks_every_selector_is_tried(setup, monkeypatch):
    monkeypatch.setattr(search_mod, "EXHAUSTIVE_TASKS", True)
    found = _search(setup, _Bench(_slow))  # only the slow selector's stacks answer
    assert found["selector"] == SLOW and found["selectors_left_out"] == []
    assert _slow(found["chosen"]["label"]) and found["chosen"]["task_acc"] == 100.0


def test_prefill_any_tries_every_selector(setup, monkeypatch):
    monkeypatch.setattr(search_mod, "EXHAUSTIVE_TASKS", True)
    bench = _Bench(lambda label: True)
    found = _search(setup, bench, prefill="any")
    assert found["selectors_left_out"] == [] and any(_slow(c["label"]) for c in found["candidates"])
    fast = _search(setup, _Bench(lambda label: True))
    # the same fast rows either way: staging changes which selectors run, not how a row is measured
    by_label = {c["label"]: c["tuning_ppl"] for c in found["candidates"]}
    assert all(by_label[c["label"]] == c["tuning_ppl"] for c in fast["candidates"] if c["label"] in by_label)


def test_fast_prefill_names_the_cheap_forms():
    assert fast_prefill("snapkv") and fast_prefill("kvzip(recon=local)")
    assert fast_prefill("observed_attention(stride=8)")
    assert fast_prefill("kvzip(recon=local,heads=pooled,layers=50%-67%,decoded=int8)")
    assert not fast_prefill("kvzip") and not fast_prefill("observed_attention")
    assert not fast_prefill("kvzip(recon=local,mix=observed_attention,share=0.1)")  # every query votes in the mix
    assert not fast_prefill("kvzip(heads=pooled,decoded=int8)")
    assert sum(map(fast_prefill, DEFAULT_SELECTORS)) >= 5  # the default trial has fast forms to pick from
    with pytest.raises(ValueError, match="prefill"):
        SearchOptions(prompt_len=4, budget=1.0, prefill="slow")
