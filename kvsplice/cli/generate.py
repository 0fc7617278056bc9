"""Generate text through a compressed KV cache: ``kvsplice generate``.

::

    kvsplice generate --model /tmp/stories260K --prompt "Once upon a time" --max-new-tokens 40
    kvsplice generate --model /tmp/stories260K --bases r4_post.safetensors --prompt "..." --json out.json
    kvsplice generate --model /tmp/stories260K --select balancekv --budget 64 --temperature 0.8 --top-k 40
    kvsplice generate --model /tmp/stories260K --method "select:snapkv@0.25+kivi4" --prompt "..."
    kvsplice generate --model ../shared/data/smollm2-135m-instruct --plan plan.json --prompt "..." \
        --max-new-tokens 64 --device cuda --dtype bf16

HF models (a directory with ``config.json``, or a Hub id) run transformers' ``generate()`` with a kvsplice cache
(:mod:`kvsplice.hf`): ``--method SPEC`` runs any registered method or stack by its spec (:mod:`kvsplice.core.build`:
the short form, inline JSON or a ``.json`` spec file; a selection's ``keep`` applies to this prompt); the aliases
``--bases F`` (= ``--method lowrank:F``: a ``fit_bases`` file) caches low-rank key/value coefficients,
``--select S --budget N`` (= ``--method select:S(seed=SEED)@N``) keeps ``N`` prompt tokens per KV head, ``--plan``
(from ``kvsplice plan``) runs the plan's stack (its selection keeps the plan's fraction of this prompt);
none → transformers' own full ``DynamicCache``. A ``.ckpt`` from ``python -m training.fit`` (not a transformers
model) runs the package's own decoder with the same options.
``--temperature 0`` (the default) is greedy; generation stops at the tokenizer's EOS. The options are declared once,
in :class:`GenerateOptions` (the parser is built from it; :func:`run` takes it).

Prints the text; ``--json OUT`` writes the generated ``tokens`` (ids, prompt excluded), ``text``,
``prompt_tokens`` and the measured ``cache_bytes`` (the cache's tensors after generation) with the formula and the
full cache's bytes. Bad input is one ``generate: error: ...`` line and exit status 2, with nothing written
(an existing ``--json`` file is replaced only with ``--force``).
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice generate"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

import torch

from kvsplice.core.limits import check_count
from kvsplice.io.cli import Parser, UsageError, device_dtype, pos_int, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.inputs import SpecArgs
from kvsplice.io.options import Exclusive, add_options, from_args, opt
from kvsplice.io.run_options import DeviceOption, DtypeOption, ForceOption
from kvsplice.io.write import write_json
from kvsplice.select.selectors import SELECTORS
from models.generate import MAX_TEMPERATURE, check_temperature

__all__ = ["GenerateOptions", "build_parser", "main", "run"]


def _temperature(s: str) -> float:
    """argparse type: a number in [0, 100] (0: greedy)."""
    try:
        return check_temperature(float(s))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, {MAX_TEMPERATURE:g}], got {s}") from None


@dataclass(frozen=True, kw_only=True)
class GenerateOptions(ForceOption, DeviceOption, DtypeOption):
    """What ``generate`` runs: the ``model`` (and ``tokenizer``), at most one cache (``method``: a spec; its
    aliases ``bases`` and ``select`` with ``budget``; or a ``plan``; none: the full cache), the ``prompt`` and
    ``max_new_tokens``, the sampling (``temperature`` 0: greedy; ``top_k``; ``seed``) and the ``json`` report.
    The fields declare the command line (in this order in ``--help``)."""

    OPTION_GROUPS: ClassVar = (Exclusive(("method", "bases", "select", "plan")),)

    model: str = opt(help="HF model directory / Hub id, or a training .ckpt")
    tokenizer: Optional[str] = opt(None, help="tokenizer directory (default: the model's)")
    method: Optional[str] = opt(None, metavar="SPEC", help="a compression method by its spec, e.g. kivi4, int8, "
                                "select:snapkv@0.25+int8, lowrank:r4.safetensors+int8, or a .json spec file")
    bases: Optional[str] = opt(None, help="low-rank bases file from kvsplice fit-bases")
    select: Optional[str] = opt(None, choices=sorted(SELECTORS), help="token selection method")
    plan: Optional[str] = opt(None, help="a plan from kvsplice plan (its stack: token selection, low rank, int8 / "
                              "KIVI; its bases file beside it)")
    budget: Optional[int] = opt(None, parse=pos_int, help="prompt tokens kept per KV head (with --select)")
    prompt: str = opt(help="the text to continue")
    max_new_tokens: int = opt(parse=pos_int, help="tokens to generate at most (it stops at the tokenizer's EOS)")
    temperature: float = opt(0.0, parse=_temperature, help="0 (default): greedy")
    top_k: Optional[int] = opt(None, parse=pos_int, help="sample from the k most likely tokens")
    seed: int = opt(0, help="seed of the sampling and of a random token selection (default 0)")
    json: Optional[str] = opt(None, help="write tokens, text and cache bytes here")

    def __post_init__(self) -> None:
        """The options together, before any file is read or the model loads (one line naming the option)."""
        given = [o for o, v in (("--method", self.method), ("--bases", self.bases), ("--select", self.select),
                                ("--plan", self.plan)) if v is not None]
        if len(given) > 1:
            raise UsageError(f"argument {given[1]}: not allowed with argument {given[0]}")
        if self.select and self.budget is None:
            raise UsageError("--select needs --budget N (prompt tokens kept per KV head)")
        if self.budget is not None and not self.select:
            raise UsageError("--budget is only used with --select METHOD")
        if self.top_k is not None and self.temperature == 0:
            raise UsageError("--top-k samples: give --temperature > 0 too (temperature 0 is greedy)")
        try:
            check_temperature(self.temperature)
        except ValueError as e:
            raise UsageError(f"--{e}") from None
        check_count("--max-new-tokens", self.max_new_tokens)  # before the model loads (its context checks it too)
        if self.budget is not None:
            check_count("--budget", self.budget)
        if self.top_k is not None:
            check_count("--top-k", self.top_k)
        if not self.prompt.strip():
            raise UsageError("--prompt is empty")
        try:
            self.prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates in sys.argv
            raise UsageError("--prompt is not valid UTF-8 text") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`GenerateOptions` (its fields declare it)."""
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_options(p, GenerateOptions, help={"force": "replace an existing --json file"})
    return p


def _check(opts: GenerateOptions) -> Optional[Path]:
    """The input files and ``--method``'s spec before the model loads; returns the ``--json`` path (checked)."""
    if opts.bases and not Path(opts.bases).is_file():
        raise UsageError(f"--bases file not found: {opts.bases}")
    if opts.plan and not Path(opts.plan).is_file():
        raise UsageError(f"--plan file not found: {opts.plan}")
    _spec(opts)
    if not opts.json:
        return None
    return output_file(opts.json, force=opts.force, option="--json",
                       inputs={"--model": opts.model, "--tokenizer": opts.tokenizer, "--bases": opts.bases,
                               "--plan": opts.plan, "--method": SpecArgs.of(opts.method)})


def _spec(opts: GenerateOptions) -> tuple[Optional[dict], Optional[Path]]:
    """The method spec of ``--method`` or of its aliases ``--bases`` / ``--select --budget`` (``None``: the full
    cache or ``--plan``), and the folder its files are read from."""
    from kvsplice.core.build import check_spec
    from kvsplice.core.short_form import load_spec

    if opts.method is not None:  # an empty spec is refused, never read as "no method" (the full cache)
        spec, base_dir = load_spec(opts.method)
        return check_spec(spec, base_dir=base_dir), base_dir  # fail fast, before the model loads
    if opts.bases:
        return {"name": "lowrank", "bases": str(Path(opts.bases).resolve())}, None
    if opts.select:
        return {"name": "token_selection", "selector": {"name": opts.select, "seed": opts.seed},
                "budget": opts.budget}, None
    return None, None


def _prompt_ids(tok, prompt: str) -> list[int]:
    ids = tok.encode(prompt)
    return [tok.bos_id] + ids if tok.sep == "bos" and tok.bos_id is not None else ids


def _decode(tok, ids: list[int]) -> str:
    return tok.backend.decode(ids, skip_special_tokens=True) if hasattr(tok.backend, "convert_ids_to_tokens") \
        else tok.backend.decode(ids)


def run(opts: GenerateOptions) -> dict[str, Any]:
    """Load the model, build the cache (``--method`` / ``--bases`` / ``--select`` / ``--plan``; none: the full
    cache), generate; returns the report (the tokens, their text, the cache's measured bytes)."""
    from kvsplice.core.build import build_method
    from kvsplice.core.short_form import format_spec
    from kvsplice.loading import load_model
    from kvsplice.lowrank.bases import KVBases
    from kvsplice.planning.spec import Plan

    if opts.bases:
        KVBases.load(opts.bases)  # checked before the model loads
    plan = Plan.load(opts.plan) if opts.plan else None
    device, dtype = device_dtype(opts)
    loaded = load_model(opts.model, tokenizer=opts.tokenizer, dtype=dtype, device=device)
    model, tok = loaded.model, loaded.tokenizer
    prompt = _prompt_ids(tok, opts.prompt)
    mp = loaded.max_positions
    if mp is not None and len(prompt) + opts.max_new_tokens > mp:
        raise UsageError(f"prompt ({len(prompt)} tokens) + --max-new-tokens {opts.max_new_tokens} exceeds the "
                         f"model's {mp} positions")
    ids = torch.tensor([prompt], device=next(model.parameters()).device)  # (1, P)
    spec, spec_dir = _spec(opts)
    method = None  # the full cache
    if spec is not None:
        if opts.method is not None:
            from kvsplice.planning.spec import check_plan_model

            check_plan_model(opts.method, model)  # a plan given as a .json spec is checked as --plan is
        method = build_method(spec, prompt_ids=ids, tokenizer=tok, base_dir=spec_dir)
    elif plan is not None:
        from kvsplice.adapters import model_fingerprint

        plan.check_model(model_fingerprint(model))
        method = plan.method(prompt_ids=ids, tokenizer=tok)
    torch.manual_seed(opts.seed)
    if loaded.kind in ("ckpt", "mla"):  # our models: the package's Decoder
        new, cache, formula, full, engine = _generate_ours(model, ids, method, opts)
    else:
        new, cache, formula, full, engine = _generate_hf(model, ids, method, opts, tok)
    from kvsplice.report.memory import measure_cache

    measured = measure_cache(cache).live_bytes
    if formula is not None and measured != formula:
        raise RuntimeError(f"measured cache bytes {measured} != formula {formula}")
    kind = "bases" if opts.bases else (f"select:{opts.select}" if opts.select else (
        f"plan:{plan.label}" if plan is not None else (f"method:{format_spec(method.spec())}" if opts.method
                                                        else "full")))
    return {"model": loaded.describe(), "engine": engine, "prompt": opts.prompt, "prompt_tokens": prompt,
            "tokens": new, "text": _decode(tok, new), "cache": kind, "method": repr(method),
            "spec": None if method is None else method.spec(), "bases": opts.bases, "plan": opts.plan,
            "budget": opts.budget, "temperature": opts.temperature,
            "top_k": opts.top_k, "seed": opts.seed, "cache_tokens_held": cache.seq_len, "cache_bytes": measured,
            "cache_bytes_formula": formula, "full_cache_bytes": full}


def _generate_hf(model, ids, method, opts: GenerateOptions, tok):
    import transformers

    from kvsplice.hf import KVSpliceHFCache

    cache = transformers.DynamicCache(config=model.config) if method is None else KVSpliceHFCache(model, method)
    sample = opts.temperature > 0
    # sampling: temperature and top-k as given (no top-k: 0, not transformers' default of 50), no top-p
    kw = dict(do_sample=True, temperature=opts.temperature, top_k=opts.top_k or 0, top_p=1.0) if sample \
        else dict(do_sample=False)
    eos = tok.eos_id if tok.eos_id is not None else model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=opts.max_new_tokens, eos_token_id=eos,
                             pad_token_id=model.generation_config.pad_token_id or eos or 0, **kw)
    new = out[0, ids.shape[1]:].tolist()
    if isinstance(cache, transformers.DynamicCache):
        from kvsplice.hf.measure import TensorsView

        view = TensorsView(cache)
        return new, view, view.nbytes(), view.nbytes(), "transformers.generate"
    return new, cache, cache.formula_nbytes(), cache.full_nbytes(), "transformers.generate"


def _generate_ours(model, ids, method, opts: GenerateOptions):
    from kvsplice.decode import Decoder
    from models.generate import generate_tokens

    dec = Decoder(model, method)
    n = opts.max_new_tokens
    cache = dec.new_cache(1, capacity=dec.method.capacity(ids.shape[1], n))
    step = lambda x, c: dec(x, c, last_only=True)  # noqa: E731
    out = generate_tokens(step, cache, ids, n, opts.temperature, opts.top_k, None)
    # the bound method's closed form (a subset cache's own bytes_formula is a static helper of other arguments)
    formula = dec.method.bytes_formula(1, cache.seq_len, cache.dtype)
    return out[0, ids.shape[1]:].tolist(), cache, formula, None, "kvsplice.decode.Decoder"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from kvsplice.lowrank.bases import BasesMismatchError

    from kvsplice.planning.spec import PlanError

    return run_cli(PROG, lambda: _main(argv), (LoadError, BasesMismatchError, PlanError, TypeError))


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = from_args(GenerateOptions, build_parser().parse_args(argv))
    json_path = _check(opts)
    report = run(opts)
    print(report["text"])
    print(f"[{len(report['tokens'])} tokens, cache: {report['cache']}, {report['cache_tokens_held']} tokens "
          f"held, {report['cache_bytes']:,} bytes measured]", file=sys.stderr)
    if json_path is not None:
        write_json(report, json_path)
        print(f"wrote {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
