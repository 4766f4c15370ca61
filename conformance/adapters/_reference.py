"""The NumPy reference's own adapter."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import damcha_core as dc

from .._cases import Case, CaseData


class ReferenceAdapter:
    """The NumPy reference through the same runner: a check of the runner and
    the catalogue (a broken case generator fails here first). The reference
    has no autodiff, so it reports outputs only."""

    name = "reference"
    dtypes: Sequence[str] = ("float64",)
    supports_gradients = False

    def unsupported(self, case: Case) -> str | None:
        return None

    def forward(self, data: CaseData, dtype: str) -> np.ndarray:
        return dc.damcha_attention(
            data.params, data.config, data.query, data.context, mask=data.mask, causal=data.causal, value=data.value
        )

    def gradients(self, data: CaseData, dtype: str) -> dict[str, np.ndarray]:
        raise NotImplementedError("the NumPy reference has no gradients")

    def decode(self, data: CaseData, dtype: str) -> np.ndarray:
        """The reference has no cache: the new tokens attend to the whole
        sequence with ``query_offset=P``, which is what a cache must reproduce."""
        P = data.case.prefix_len
        return dc.damcha_attention(data.params, data.config, data.query[:, P:], data.query, causal=True, query_offset=P)
