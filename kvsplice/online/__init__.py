"""Online frequent-directions bases: the FD sketch (``fd``), blockwise softmax (``blockwise``), the chunked cache
(``chunks``, ``chunked``) and attention over it (``attention``), chunk / FD diagnostics (``diagnostics``), and the
``OnlineFD`` compression method (``method``). The attention-error bounds live in :mod:`kvsplice.core.bounds`."""

from kvsplice.online.chunked import ChunkedCache
from kvsplice.online.fd import FrequentDirections
from kvsplice.online.method import OnlineDecoder, OnlineFD, calibrate_thresholds

__all__ = ["ChunkedCache", "FrequentDirections", "OnlineDecoder", "OnlineFD", "calibrate_thresholds"]
