"""A deliberately wrong third-party adapter, loaded by the CLI test as module:attr."""

from __future__ import annotations

import numpy as np

import damcha_core as dc
from damcha_conformance import ReferenceAdapter


class WrongMask(ReferenceAdapter):
    """Reads the mask with the opposite polarity (True = masked out)."""

    name = "wrong-mask"

    def forward(self, data, dtype):
        mask = None if data.mask is None else ~data.mask
        return np.nan_to_num(dc.damcha_attention(data.params, data.config, data.query, data.context, mask=mask, causal=data.causal))
