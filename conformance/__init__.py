"""damcha_conformance: holds every backend, including third-party ports, to the reference.

A port implements ``BackendAdapter`` and calls ``run_conformance``; the CLI
``damcha conform`` runs every installed backend and prints a table.
"""

from __future__ import annotations

from ._adapter import BackendAdapter, ReferenceAdapter
from ._cases import (
    CATALOGUE,
    GROUPS,
    Case,
    CaseData,
    case_params,
    catalogue,
    gradient_targets,
    materialise,
    reference_directional,
)
from ._runner import Report, Result, check_case, run_conformance
from ._tolerances import DTYPES, TOLERANCES, Tolerance, tolerance

__all__ = [
    "BackendAdapter",
    "CATALOGUE",
    "Case",
    "CaseData",
    "DTYPES",
    "GROUPS",
    "ReferenceAdapter",
    "Report",
    "Result",
    "TOLERANCES",
    "Tolerance",
    "case_params",
    "catalogue",
    "check_case",
    "gradient_targets",
    "materialise",
    "reference_directional",
    "run_conformance",
    "tolerance",
]
