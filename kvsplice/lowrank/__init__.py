"""Post-training low-rank bases: calibration Grams (``calibrate``), per-head fits (``fits``) and their errors from
the Grams (``fit_errors``), the bases container (``bases``), the coefficient cache (``cache``), attention in
coefficient space (``attention``) and the ``LowRank`` compression method (``method``), plus error diagnostics of
fitted bases (``diagnostics``); one calibration pass for every method with loss sensitivities (``sensitivity``), rank
allocation under a budget (``allocate``) and grouped-head joint bases (``joint``)."""

from kvsplice.lowrank.bases import BasesMismatchError, HeadBases, KVBases
from kvsplice.lowrank.cache import CoefficientCache
from kvsplice.lowrank.calibrate import CalibrationStats, calibrate, calibration_batches
from kvsplice.lowrank.fits import FITS, fit_bases
from kvsplice.lowrank.method import LowRank

__all__ = ["BasesMismatchError", "CalibrationStats", "CoefficientCache", "HeadBases", "KVBases", "LowRank", "FITS",
           "calibrate", "calibration_batches", "fit_bases"]
