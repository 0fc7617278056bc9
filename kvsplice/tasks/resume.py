"""Resuming an ``eval_tasks --out``: the one check that the run continuing a results file would give the answers
the file holds, and that the file's header still describes every instance in it.

The rule (docs/tasks.md, "Resuming --out"):

* **same computation** — the model (fingerprint), the tokenizer (fingerprint), the ``--stories`` text (digest),
  ``--door`` and ``--dtype`` (:data:`SAME`) must equal the file's; any difference is refused in one line naming the
  option (``--force`` starts over);
* **more instances only** — ``--tasks``, ``--lengths``, ``--n`` / ``--seed0`` and ``--setting`` may grow: every
  instance the file holds answers for must be one this run makes (its setting, task, length and seed among this
  run's), with the same prompt (its digest: the same ids and expected answers; a changed task generator is caught
  here). Otherwise the run is refused, naming the option that leaves the old answers out; the header written is this
  run's, which then describes them all;
* **methods** — a method is its spec string; one whose label or files (the plan or spec file and the bases it names,
  by digest) changed since loses its old answers, which are run again (a note on stderr); methods of earlier runs
  that this run does not name keep their answers and their records in the header.

* **re-derived** — a kept answer is dropped, and run again when this run names its method (one note on stderr),
  unless its method is one the header records, its ``tokens`` are integers within the model's vocabulary (no more
  than the instance's answer tokens), its ``output`` is what the tokenizer decodes them to, and its ``n_prompt`` is
  the instance's prompt length within the model's positions (:func:`rederive`): a forged output cannot score.
* **scores** — a kept answer's score is recomputed from its recorded output (:func:`rescore`): a score that does not
  match its output (a hand-edited ``score: 1.0``) is corrected, with a note on stderr.

The file's shape is checked first (:func:`kvsplice.tasks.results_schema.check_results_doc`): a hand-edited file is
refused in one line, never half-trusted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvsplice.io.cli import UsageError
from kvsplice.tasks.results_schema import FORMAT, check_results_doc, instance_key

__all__ = ["SAME", "load_results", "rederive", "rescore", "resume"]

SAME: dict[str, str] = {"door": "--door", "dtype": "--dtype", "model_fingerprint": "--model",
                        "tokenizer_fingerprint": "--tokenizer", "stories_digest": "--stories"}
"""Recorded setting → the option that sets it: settings a resumed run must share with the file (checked in this
order: another dtype changes the model's fingerprint too, and is named first)."""
_START_OVER = "use --force to start over, or another --out"


def load_results(path: Path) -> dict[str, Any]:
    """The parsed, checked results file at ``path``; a :class:`UsageError` (one line) when it is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UsageError(f"--out {path} exists and is not an eval_tasks result ({_START_OVER} to replace it)")
    try:
        check_results_doc(doc)
    except ValueError as e:
        raise UsageError(f"--out {path} cannot be resumed: {e}; {_START_OVER}") from None
    return doc


def _check_same(doc: dict, header: dict, path: Path, aliases: dict) -> None:
    for name, option in SAME.items():
        if doc[name] != header[name] and doc[name] not in aliases.get(name, ()):
            raise UsageError(f"--out {path} was made with another {option} ({name} {doc[name]!r}, now "
                             f"{header[name]!r}): its answers are not this run's; {_START_OVER}")


def _check_extent(doc: dict, header: dict, path: Path) -> None:
    """Every answered instance of ``doc`` is one of ``header``'s, with the same prompt."""
    seeds = range(header["seed0"], header["seed0"] + header["n"])
    for setting, by_inst in doc["results"].items():
        if by_inst and setting not in header["settings"]:
            raise UsageError(f"--out {path} holds {setting} answers that --setting {'/'.join(header['settings'])} "
                             f"would leave undescribed; give --setting both, or {_START_OVER}")
        for key in by_inst:
            task, length, seed = instance_key(key)
            if task not in header["tasks"]:
                raise UsageError(f"--out {path} holds answers of task {task} that --tasks leaves out; add it, or "
                                 f"{_START_OVER}")
            if length not in header["lengths"]:
                raise UsageError(f"--out {path} holds answers at length {length} that --lengths leaves out; add it, "
                                 f"or {_START_OVER}")
            if seed not in seeds:
                raise UsageError(f"--out {path} holds answers of seed {seed}, outside this run's seeds "
                                 f"{seeds.start}..{seeds.stop - 1} (--seed0 {header['seed0']} --n {header['n']}); "
                                 f"give --seed0/--n that cover seeds {doc['seed0']}..{doc['seed0'] + doc['n'] - 1}, "
                                 f"or {_START_OVER}")
            old, new = doc["instances"].get(key), header["instances"].get(key)
            if old is None or new is None:  # not listed, or spelled otherwise ("passkey/0160/0")
                raise UsageError(f"--out {path} cannot be resumed: results hold instance {key!r} that its instances "
                                 f"do not list as eval_tasks writes them; {_START_OVER}")
            if old != new:
                raise UsageError(f"--out {path}: instance {key}'s prompt differs from the one its answers were given "
                                 f"to (the task generators changed?); {_START_OVER}")


def _changed_methods(doc: dict, header: dict) -> list[str]:
    """The methods this run names whose label or files differ from the file's record of them."""
    before, files = doc["methods"], doc["method_files"]
    return sorted(k for k, label in header["methods"].items() if k in before and (
        before[k] != label or files.get(k, {}) != header["method_files"].get(k, {})))


def resume(path: Path, force: bool, header: dict,
           aliases: Optional[Callable[[dict], dict[str, Sequence[str]]]] = None) -> dict:
    """The finished results of ``path`` that this run (``header``: its recorded settings) continues — ``{}`` when
    there is no file or ``force`` — after the checks of the module docstring; ``header`` gets the records of the
    methods run before. ``aliases(doc)``: other recorded values that mean this run's setting (the tokenizer's
    fingerprint in its earlier form, which hashed the path the file records it was loaded from). A
    :class:`UsageError` when the file cannot be continued."""
    if force or not path.exists():
        return {}
    doc = load_results(path)
    _check_same(doc, header, path, aliases(doc) if aliases else {})
    _check_extent(doc, header, path)
    results = doc["results"]
    for k in _changed_methods(doc, header):  # the same spec names another method now: run it again
        print(f"eval_tasks: {k} was {doc['methods'][k]!r} (or its files changed), now {header['methods'][k]!r}: "
              f"its results are run again", file=sys.stderr)
        for by_inst in results.values():
            for outs in by_inst.values():
                outs.pop(k, None)
    header["methods"] = {**doc["methods"], **header["methods"]}
    header["method_files"] = {**doc["method_files"], **header["method_files"]}
    return results


def rescore(results: dict, insts: Sequence[Any], path: Path) -> int:
    """Recompute every kept answer's score from its recorded ``output`` (the instance's exact-match score): the file
    holds outputs, the scores are derived from them. A score that differs (a hand-edited result) is corrected in
    ``results`` with a note on stderr; returns how many were."""
    by_key = {i.key: i for i in insts}
    fixed = 0
    for setting, by_inst in results.items():
        for key, outs in by_inst.items():
            inst = by_key.get(key)
            if inst is None:
                continue
            for method, o in outs.items():
                score = inst.score(o["output"])
                if score != o["score"]:
                    print(f"note: --out {path}: {setting} {key} {method}: recorded score {o['score']!r} does not "
                          f"match its recorded output (scores {score:g}); re-scored", file=sys.stderr)
                    o["score"] = score
                    fixed += 1
    return fixed


def _derived_problem(o: dict, inst: Any, method: str, methods: dict, decode: Callable[[list], str], vocab: int,
                     max_positions: Optional[int]) -> Optional[str]:
    """Why the outcome ``o`` of ``inst`` is not what its own record derives (``None`` when it is)."""
    if method not in methods:
        return f"method {method!r} is not one the file records"
    tokens = o.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > inst.max_new_tokens or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
        return f"its tokens are not at most {inst.max_new_tokens} ids of the model's {vocab}"
    n = o.get("n_prompt")
    limit = max_positions if max_positions is not None else inst.length + inst.max_new_tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit or n != inst.meta.get("n_tokens", n):
        return f"its n_prompt {n!r} is not the instance's prompt length"
    try:
        text = decode(tokens)
    except Exception:  # noqa: BLE001 - ids the tokenizer cannot decode
        text = None
    if text != o.get("output"):
        return "its output is not what its tokens decode to"
    return None


def rederive(results: dict, insts: Sequence[Any], methods: dict, path: Path, *, decode: Callable[[list], str],
             vocab: int, max_positions: Optional[int]) -> int:
    """Drop every kept answer that its own record does not derive (:func:`_derived_problem`): its method re-runs
    when this run names it. One note on stderr names the first and the count; returns how many were dropped."""
    by_key = {i.key: i for i in insts}
    dropped: list[str] = []
    for setting, by_inst in results.items():
        for key, outs in by_inst.items():
            inst = by_key.get(key)
            if inst is None:
                continue
            for method in list(outs):
                why = _derived_problem(outs[method], inst, method, methods, decode, vocab, max_positions)
                if why is not None:
                    dropped.append(f"{setting} {key} {method}: {why}")
                    del outs[method]
    if dropped:
        print(f"note: --out {path}: {len(dropped)} recorded answer(s) do not follow from their own record (first: "
              f"{dropped[0]}); run again", file=sys.stderr)
    return len(dropped)
