"""Language-neutral test vectors: JSON descriptions plus safetensors tensors.

A port in any language with a safetensors reader checks itself with them:

1. Read ``index.json``; for each case read ``<name>.json`` and ``<name>.safetensors``.
2. Build the layer from ``config`` and the ``params.*`` tensors (canonical names).
3. Run it on ``inputs.query`` (and ``inputs.context`` when present: the key
   tokens, and the value tokens too unless ``inputs.value`` (B, M, E_v) is
   present) with ``inputs.mask`` (bool, True = may attend, 4-D broadcastable
   to (B, H, N, M)) and the ``causal`` flag; compare with ``expected.output``
   using the dtype's tolerance: ``|y - expected| <= atol + rtol * |expected|``;
   where ``expected.output`` is NaN (a case with a NaN input token) ``y`` must be
   non-finite, and finite everywhere else. A case whose ``dtypes`` is not null
   is checked in those dtypes only (the float16 large-activation cases: tokens
   whose mean square overflows float16, so phi's statistic must be taken in at
   least float32).
4. Gradients: with loss = sum(output * ``gradients.cotangent``), the
   directional derivative ``sum(grad_T * gradients.direction.T)`` of each
   listed tensor T must match ``directional_derivatives[T]`` within
   ``grad_atol + grad_rtol * rms(grad_T)``, rms(g) = ||g|| / sqrt(g.size).
5. Decoding cases (``decode`` is not null): ``inputs.query`` is a whole
   sequence of P + N tokens, P = ``decode.prefix_len``. Read its first P
   tokens into the port's key/value cache, then the remaining N, causally;
   ``expected.output`` holds the outputs of those N tokens (query i of them
   sits at position P + i and sees keys j <= P + i), and the tensor named by
   ``decode.prefill`` (``expected.prefill``) those of the P prefill tokens
   (a causal pass over the prefix).
6. Bad-input cases (``index.json``'s ``error_cases``, file names: the case id
   with ":" written "--"; their ``error`` is not null): the inputs are those of a valid case with one tensor corrupted
   (``error.corruption``: one feature too many, an extra leading axis, a mask
   axis that is neither 1 nor its size, ...). The port must refuse the call
   with its language's argument error (Python: a ``ValueError``) whose
   message names the argument (one of ``error.names``, as a word of its own)
   and says what it received (the word "received" or "got"); returning any
   output fails: the input was silently sliced, padded or broadcast. There is
   no ``expected.output``.
7. Attention weights (``weights`` is not null: the name of the tensor,
   ``expected.weights``): the probabilities (B, H, N, M) of the same call, one
   map per query head (not averaged), after the mask and the causal rule; a
   query that sees no key has probabilities 0. Compared as the output is, at
   the dtype's output tolerance.
8. Metric penalty (``penalty`` is not null): the mean over adapted roles of
   mean_t ||L(t) - I||_F^2 / (S*d) of the case's params and tokens (the
   values are never mapped, the mask plays no part) must match
   ``penalty.value`` at the dtype's output tolerance; its gradients, along
   ``penalty.direction.<T>``, must match ``penalty.directional_derivatives[T]``
   as in step 4 (0 for the tensors the penalty does not read).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ._cases import (
    PENALTY_CASES,
    WEIGHTS_CASES,
    Case,
    DecodeCase,
    ErrorCase,
    materialise,
    materialise_decode,
    materialise_error,
    reference_directional,
    reference_penalty,
    reference_penalty_directional,
    reference_prefill,
    reference_weights,
)
from ._tolerances import TOLERANCES

FORMAT = "damcha-conformance-vectors-v1"


def vector_files(directory: str | os.PathLike) -> set[Path]:
    """The case files (``<name>.json``, ``<name>.safetensors``) the ``index.json`` of an export in
    ``directory`` lists; empty when there is none (or it is of another kind)."""
    out = Path(directory)
    try:
        index = json.loads((out / "index.json").read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return set()
    names = [n for key in ("cases", "error_cases") for n in index.get(key) or () if isinstance(n, str)]
    return {out / f"{_file_stem(n)}{suffix}" for n in names for suffix in (".json", ".safetensors")}


def _file_stem(name: str) -> str:
    """A case's name as a file name: a bad-input case's ``query-features:heads-tied-self`` has a
    colon, which Windows refuses in file names (no other case has one)."""
    return name.replace(":", "--")


def _entry(name: str, group: str, config, data, *, expected: bool = True, **fields) -> tuple[dict, dict]:
    """The tensors and JSON description every case shares (the output and its tolerances where the
    case has an ``expected`` output: a bad-input case has none); ``fields`` fill in the rest."""
    tensors = {f"params.{k}": v for k, v in data.params.items()}
    tensors["inputs.query"] = data.query
    for key in ("context", "value", "mask"):
        if getattr(data, key, None) is not None:
            tensors[f"inputs.{key}"] = getattr(data, key)
    description = {
        "format": FORMAT,
        "name": name,
        "group": group,
        "config": config.to_dict(),
        "tensors": f"{_file_stem(name)}.safetensors",
        "dtypes": None,
        "gradients": None,
        "weights": None,
        "penalty": None,
        **fields,
    }
    if expected:
        tensors["expected.output"] = data.expected
        description["tolerances"] = {k: vars(v) for k, v in TOLERANCES.items()}
    return tensors, description


def export_vectors(
    directory: str | os.PathLike,
    cases: list[Case],
    decode_cases: list[DecodeCase] | tuple[DecodeCase, ...] = (),
    error_cases: list[ErrorCase] | tuple[ErrorCase, ...] = (),
) -> list[Path]:
    """Write ``cases`` (and ``decode_cases``, ``error_cases``) under ``directory``; returns the JSON
    paths written. ``index.json`` lists the bad-input cases apart (``error_cases``), so a runner
    written for ``cases`` never feeds them to a model."""
    from safetensors.numpy import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    mask_semantics = "bool, True = may attend; 4-D, broadcastable to (B, H, N, M)"
    entries = []
    for case in cases:
        data = materialise(case)
        tensors, description = _entry(
            case.name,
            case.group,
            case.config,
            data,
            causal=case.causal,
            self_attention=case.self_attention,
            decode=None,
            mask_semantics=mask_semantics,
        )
        if case.gradients:
            tensors["gradients.cotangent"] = data.cotangent
            directional = {}
            for target, (direction, dd) in reference_directional(case).items():
                tensors[f"gradients.direction.{target}"] = direction
                directional[target] = dd
            description["gradients"] = {
                "loss": "sum(output * gradients.cotangent)",
                "directional_derivatives": directional,
            }
        if case.dtypes is not None:
            description["dtypes"] = list(case.dtypes)
        if case in WEIGHTS_CASES:
            tensors["expected.weights"] = reference_weights(case)
            description["weights"] = "expected.weights"
        if case in PENALTY_CASES:
            penalty: dict[str, object] = {"value": reference_penalty(case)}
            if case.gradients:
                penalty_directional = {}
                for target, (direction, dd) in reference_penalty_directional(case).items():
                    tensors[f"penalty.direction.{target}"] = direction
                    penalty_directional[target] = dd
                penalty["directional_derivatives"] = penalty_directional
            description["penalty"] = penalty
        entries.append((case.name, tensors, description))
    for dcase in decode_cases:
        tensors, description = _entry(
            dcase.name,
            dcase.group,
            dcase.config,
            materialise_decode(dcase),
            causal=True,
            self_attention=True,
            decode={"prefix_len": dcase.prefix_len, "new_len": dcase.new_len, "prefill": "expected.prefill"},
            mask_semantics=None,
        )
        tensors["expected.prefill"] = reference_prefill(dcase)
        entries.append((dcase.name, tensors, description))
    errors = []
    for ecase in error_cases:
        tensors, description = _entry(
            ecase.name,
            ecase.group,
            ecase.base.config,
            materialise_error(ecase),
            expected=False,
            causal=ecase.base.causal,
            self_attention=ecase.base.self_attention,
            decode=None,
            mask_semantics=mask_semantics,
            error={
                "corruption": ecase.corruption,
                "argument": ecase.argument,
                "names": list(ecase.names),
                "base_case": ecase.base.name,
            },
        )
        errors.append((_file_stem(ecase.name), tensors, description))
    written = []
    for name, tensors, description in entries + errors:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / f"{name}.safetensors"))
        path = out / f"{name}.json"
        path.write_text(json.dumps(description, indent=1))
        written.append(path)
    index = {
        "format": FORMAT,
        "procedure": __doc__,
        "cases": [name for name, _, _ in entries],
        "error_cases": [name for name, _, _ in errors],
    }
    (out / "index.json").write_text(json.dumps(index, indent=1))
    return written
