"""How many latent dimensions KVSplice keeps, and the rule that refuses a kept fraction that keeps none.

KVSplice keeps ``round(R · keep)`` of an ``R``-dimensional latent (``keep``: the kept fraction, ``to_mla
--kvsplice-keep``; the model configs' ``kvsplice_ratio`` is the same fraction — "ratio" elsewhere means times
smaller). It must ask for at least one whole dimension (``R · keep >= 1``, i.e. ``keep >= 1/R``): below it the latent
would be rounded up to a dimension nobody asked for (``--kvsplice-keep 0.001`` of a 64-dim latent is 0.064
dimensions), which is a different compression than the one requested and never a useful one. The rule depends on
the latent only, so every door (``to_mla`` on a GPT checkpoint or a Llama-family model, the library's :func:`~kvsplice.convert.mla.insert_kvsplice` and
:func:`~kvsplice.convert.llama_mla.shrink_latent`) checks it the same way, before any calibration.
"""

from __future__ import annotations

from kvsplice.core.amounts import check_kept_fraction

__all__ = ["kept_dims"]


def kept_dims(keep: float, d_latent: int, option: str = "kvsplice keep") -> int:
    """``round(d_latent · keep)``: the dimensions KVSplice keeps; a ``ValueError`` (one line, naming ``option``)
    when the kept fraction ``keep`` is not in (0, 1) or asks for less than one whole dimension."""
    keep = check_kept_fraction(option, keep)
    if d_latent * keep < 1:
        raise ValueError(f"{option} {keep:g} of the {d_latent}-dim latent asks for {d_latent * keep:.3g} dimensions; "
                         f"it must keep at least one whole dimension (kept fraction >= 1/{d_latent} = "
                         f"{1 / d_latent:.4g})")
    return round(d_latent * keep)
