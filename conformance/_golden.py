"""The frozen golden file: catches the reference (or the catalogue) drifting silently.

``data/golden.npz`` holds, per case, the reference output (every 37th row of
the long cases, to stay small) and the central-difference directional
derivatives; for the cases of ``WEIGHTS_CASES`` the attention weights
(``<case>/weights``), and for those of ``PENALTY_CASES`` the metric penalty and
its directional derivatives (``<case>/penalty``, ``<case>/penalty/directional``).
Cases appended to the catalogue are added with ``python -m
damcha_conformance._golden --append`` (existing entries copied bit for bit);
regenerate it all only for an intended spec change, and say so in the commit
message: ``python -m damcha_conformance._golden --write``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ._cases import (
    CATALOGUE,
    PENALTY_CASES,
    WEIGHTS_CASES,
    Case,
    materialise,
    reference_directional,
    reference_penalty,
    reference_penalty_directional,
    reference_weights,
)

PATH = Path(__file__).parent / "data" / "golden.npz"
LONG_STRIDE = 37


def golden_entries(case: Case) -> dict[str, np.ndarray]:
    """The frozen arrays of ``case``: its output (thinned when long) and directional derivatives,
    and its weights and metric penalty where those are checked."""
    out = materialise(case).expected
    if out.shape[1] >= 256:
        out = out[:, ::LONG_STRIDE]
    entries = {f"{case.name}/output": out}
    if case.gradients:
        entries[f"{case.name}/directional"] = np.array([dd for _, dd in reference_directional(case).values()])
    if case in WEIGHTS_CASES:
        entries[f"{case.name}/weights"] = reference_weights(case)
    if case in PENALTY_CASES:
        entries[f"{case.name}/penalty"] = np.array(reference_penalty(case))
        if case.gradients:  # "/directional" last: the golden test's looser bound for central differences
            directional = reference_penalty_directional(case).values()
            entries[f"{case.name}/penalty/directional"] = np.array([dd for _, dd in directional])
    return entries


def write(path: Path = PATH) -> None:
    """Rewrite every entry (an intended spec change only)."""
    arrays: dict[str, np.ndarray] = {}
    for case in CATALOGUE:
        arrays.update(golden_entries(case))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)  # type: ignore[arg-type]  # NumPy's stub reads **arrays as allow_pickle


def append(path: Path = PATH) -> list[str]:
    """Add the entries of cases appended to the catalogue; every existing
    entry is copied bit for bit. Returns the keys added."""
    arrays = load(path)
    added = []
    for case in CATALOGUE:
        for key, value in golden_entries(case).items():
            if key not in arrays:
                arrays[key] = value
                added.append(key)
    np.savez_compressed(path, **arrays)  # type: ignore[arg-type]  # NumPy's stub reads **arrays as allow_pickle
    return added


def load(path: Path = PATH) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


if __name__ == "__main__":
    if sys.argv[1:] == ["--append"]:
        print(f"added {append()} to {PATH}")
    elif sys.argv[1:] == ["--write"]:
        write()
        print(f"wrote {PATH}")
    else:
        raise SystemExit("usage: python -m damcha_conformance._golden --append | --write")
