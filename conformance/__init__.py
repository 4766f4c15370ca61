"""damcha_conformance: holds every backend, including third-party ports, to the reference.

A port implements ``BackendAdapter`` and calls ``run_conformance``; the CLI
``damcha conform`` runs every installed backend and prints a table. This
project's own adapters live in ``damcha_conformance.adapters`` (each imported
on first use).
"""

from __future__ import annotations

from ._adapter import BackendAdapter
from ._cases import (
    CATALOGUE,
    CORRUPTIONS,
    DECODE_CATALOGUE,
    ERROR_CATALOGUE,
    GROUPS,
    LARGE,
    PENALTY_CASES,
    WEIGHTS_CASES,
    Case,
    CaseData,
    DecodeCase,
    ErrorCase,
    ReferenceData,
    case_params,
    catalogue,
    gradient_targets,
    materialise,
    materialise_decode,
    materialise_error,
    reference_directional,
    reference_penalty,
    reference_penalty_directional,
    reference_prefill,
    reference_weights,
)
from ._runner import (
    Check,
    Report,
    Result,
    check_case,
    check_decode,
    check_error,
    check_penalty,
    check_penalty_gradients,
    check_weights,
    run_conformance,
)
from ._tolerances import DTYPES, TOLERANCES, Tolerance, tolerance
from .adapters import load_adapter
from .adapters._reference import ReferenceAdapter

__all__ = [
    "BackendAdapter",
    "CATALOGUE",
    "CORRUPTIONS",
    "Case",
    "CaseData",
    "Check",
    "DECODE_CATALOGUE",
    "DTYPES",
    "DecodeCase",
    "ERROR_CATALOGUE",
    "ErrorCase",
    "GROUPS",
    "LARGE",
    "PENALTY_CASES",
    "ReferenceAdapter",
    "ReferenceData",
    "Report",
    "Result",
    "TOLERANCES",
    "Tolerance",
    "WEIGHTS_CASES",
    "case_params",
    "catalogue",
    "check_case",
    "check_decode",
    "check_error",
    "check_penalty",
    "check_penalty_gradients",
    "check_weights",
    "gradient_targets",
    "load_adapter",
    "materialise",
    "materialise_decode",
    "materialise_error",
    "reference_directional",
    "reference_penalty",
    "reference_penalty_directional",
    "reference_prefill",
    "reference_weights",
    "run_conformance",
    "tolerance",
]
