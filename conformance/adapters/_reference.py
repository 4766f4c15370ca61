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

    def weights(self, data: CaseData, dtype: str) -> np.ndarray:
        _, probs = dc.damcha_attention(
            data.params,
            data.config,
            data.query,
            data.context,
            mask=data.mask,
            causal=data.causal,
            value=data.value,
            return_weights=True,
        )
        return np.asarray(probs)

    def metric_penalty(self, data: CaseData, dtype: str) -> float:
        return dc.metric_penalty(data.params, data.config, data.query, data.context, value=data.value)

    def decode(self, data: CaseData, dtype: str) -> np.ndarray:
        """The reference has no cache: the prefill is a causal pass over the prefix, and the new
        tokens attend to the whole sequence with ``query_offset=P``, which is what a cache must
        reproduce. Both, (B, P + N, E_o)."""
        P, x = data.case.prefix_len, data.query
        prefill = dc.damcha_attention(data.params, data.config, x[:, :P], causal=True)
        rest = dc.damcha_attention(data.params, data.config, x[:, P:], x, causal=True, query_offset=P)
        return np.concatenate([prefill, rest], axis=1)
