"""The backend adapter protocol (the built-in adapters live in ``damcha_conformance.adapters``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ._cases import Case, CaseData


@runtime_checkable
class BackendAdapter(Protocol):
    """What a port implements to be held to the reference by ``run_conformance``.

    An adapter loads the canonical float64 params of a case into its own
    framework (cast to ``dtype``), runs the layer and hands back NumPy arrays
    of ``dtype``, or of a wider float holding ``dtype`` values (a float64 copy);
    values that are not ``dtype`` values fail the check.
    Masks arrive 4-D (B|1, H|1, N|1, M) with True = may attend; the adapter
    converts to its framework's convention at its boundary. ``data.value``,
    when not None, holds value tokens (B, M, E_v) separate from the context
    (the keys). ``data`` is a ``CaseData`` without the expected output (the
    runner keeps the ``ReferenceData``), so a port cannot return it.

    Attributes:
        name: short id shown in the report, e.g. "torch".
        dtypes: the dtype names (keys of ``TOLERANCES``) it should be run in.
        supports_gradients: whether ``gradients`` is implemented.
    """

    name: str
    dtypes: Sequence[str]
    supports_gradients: bool

    def unsupported(self, case: Case) -> str | None:
        """``None`` if the adapter can run ``case``, else the reason it cannot
        (reported as "unsupported", never as a pass)."""
        ...

    def forward(self, data: CaseData, dtype: str) -> np.ndarray:
        """The output (B, N, E_o) of ``data.case`` computed in ``dtype``."""
        ...

    def gradients(self, data: CaseData, dtype: str) -> dict[str, np.ndarray]:
        """Gradients of ``sum(output * data.cotangent)`` with respect to
        "query", "context" (cross-attention only), "value" (when
        ``data.value`` is not None) and every canonical parameter name, each
        shaped like that tensor."""
        ...

    # Optional methods: an adapter without one reports its checks as
    # "unsupported" (a gap: the verdict is PARTIAL, never a silent pass).
    #
    # ``decode(data, dtype) -> np.ndarray``. For a ``DecodeCase``,
    # ``data.query`` is the whole sequence (B, P + N, E); read its first
    # ``data.case.prefix_len`` tokens into the port's key/value cache, then
    # the rest, and return the outputs of every token fed (B, P + N, E_o),
    # the prefill's first. Returning those of the rest alone (B, N, E_o), as
    # adapters written before did, still works; the prefill is then unchecked.
    #
    # ``weights(data, dtype) -> np.ndarray``: the attention probabilities
    # (B, H, N, M) of the case (the layer's need_weights /
    # return_attention_scores / return_weights), one map per query head (not
    # averaged), after the mask and the causal rule; a query that sees no key
    # has probabilities 0. Computed in ``dtype`` and returned as ``forward``'s
    # output is.
    #
    # ``metric_penalty(data, dtype) -> float``: the metric penalty of the
    # case's params and tokens (``damcha_core.metric_penalty``: the values
    # are never mapped, the mask plays no part), a float or 0-d array.
    #
    # ``metric_penalty_gradients(data, dtype) -> dict[str, np.ndarray]``
    # (asked for when ``supports_gradients``): the gradients of that penalty,
    # keyed as ``gradients``' (0 for the tensors the penalty does not read).
