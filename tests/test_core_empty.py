"""Empty shapes in the reference (the spec): an empty batch (B = 0) or no query
(N = 0, also self-attention's N = M = 0) gives the empty output, as the
frameworks' MHA do; queries over no key (M = 0, N >= 1) are refused, naming
the argument; every other rule is as strict on empty inputs as on full ones."""

from __future__ import annotations

import numpy as np
import pytest

import damcha_core as dc
from damcha_core._reference import dense_map

CROSS = dc.DamchaConfig(
    query_dim=8, num_heads=2, key_dim=4, context_dim=6, coupling="separate", value_dim=3, output_dim=5
)
SELF = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, metric="lowrank", metric_rank=2)


def _params(config: dc.DamchaConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    params = dc.init_params(config, 0)
    # Open gates: the maps are not the identity, so the penalty is not 0 by construction.
    return {k: v + rng.uniform(0.3, 0.9, v.shape) if k.endswith("gate") else v for k, v in params.items()}


# (config, B, N, M) with M None for self-attention.
SHAPES = {
    "B0-self": (SELF, 0, 4, None),
    "B0-cross": (CROSS, 0, 3, 5),
    "N0-cross": (CROSS, 2, 0, 5),
    "N0-self": (SELF, 2, 0, None),
    "B0-N0-cross": (CROSS, 0, 0, 5),
}


@pytest.mark.parametrize("path", ["fast", "explicit"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_reference_returns_the_empty_output(shape, path) -> None:
    config, B, N, M = shape
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, N, config.query_dim)).astype(np.float32)
    c = None if M is None else rng.normal(size=(B, M, config.context_dim))
    K = N if M is None else M
    mask = np.ones((B, 1, N, K), bool)
    y, w, maps = dc.damcha_attention(
        _params(config), config, x, c, mask=mask, causal=True, return_weights=True, return_metric=True, path=path
    )
    assert (y.shape, y.dtype) == ((B, N, config.output_dim), np.float64)
    assert w.shape == (B, config.num_heads, N, K)
    sides = {"q": (B, N), "k": (B, K)}
    for role, m in maps.items():
        assert m.shape[:2] == sides[role], role


def test_empty_rows_leave_the_other_rows_as_they_were() -> None:
    """Batch entries are independent: the output of a batch is the outputs of
    its entries, so an empty batch is the empty slice of any batch's output."""
    rng = np.random.default_rng(2)
    params = _params(CROSS)
    x, c = rng.normal(size=(3, 4, 8)), rng.normal(size=(3, 5, 6))
    full = dc.damcha_attention(params, CROSS, x, c)
    np.testing.assert_array_equal(dc.damcha_attention(params, CROSS, x[:0], c[:0]), full[:0])
    np.testing.assert_array_equal(dc.damcha_attention(params, CROSS, x[:, :0], c), full[:, :0])


def _dense_penalty(params, config, side, tokens) -> float:
    """mean_t ||L(t) - I||_F^2 / (S d) from the dense map, an independent form."""
    S, d = config.side_heads(side), config.key_dim
    L = dense_map(params, config, side, tokens).reshape(*tokens.shape[:2], S * d, S * d)
    return float(np.mean(np.sum((L - np.eye(S * d)) ** 2, axis=(-2, -1)))) / (S * d)


def test_metric_penalty_over_no_token_is_zero() -> None:
    """An empty batch adds nothing to a loss: the mean over no token is 0, not NaN."""
    rng = np.random.default_rng(3)
    params = _params(CROSS)
    x, c = rng.normal(size=(2, 4, 8)), rng.normal(size=(2, 5, 6))
    with np.errstate(all="raise"):
        assert dc.metric_penalty(params, CROSS, x[:0], c[:0]) == 0.0
        assert dc.metric_penalty(_params(SELF), SELF, x[:, :0]) == 0.0
        # No query, five keys: the query role adds 0, the key role its own mean.
        got = dc.metric_penalty(params, CROSS, x[:, :0], c)
    want = (0.0 + _dense_penalty(params, CROSS, "k", c)) / 2
    assert got == pytest.approx(want, rel=1e-12) and want > 0


# fmt: off
@pytest.mark.parametrize(
    "query, context, mask, error, pattern",
    [
        ((2, 3, 8), (2, 0, 6), None, dc.DamchaValueError, r"^Invalid argument `context`: expected at least one key \(M >= 1\) when there are queries: a query row with no key has no defined output\. Received: context\.shape=\(2, 0, 6\)$"),
        ((0, 3, 8), (0, 0, 6), None, dc.DamchaValueError, r"^Invalid argument `context`: expected at least one key \(M >= 1\).*Received: context\.shape=\(0, 0, 6\)$"),
        ((0, 3, 7), (0, 5, 6), None, dc.DamchaValueError, r"^Invalid argument `query`: expected 8 features \(config\.query_dim\)\. Received: query\.shape=\(0, 3, 7\)$"),
        ((0, 3, 8), (0, 5, 7), None, dc.DamchaValueError, r"^Invalid argument `context`: expected 6 features.*Received: context\.shape=\(0, 5, 7\)$"),
        ((0, 3, 8), (1, 5, 6), None, dc.DamchaValueError, r"^Invalid argument `context`: expected the batch size of `query`"),
        ((0, 8), (0, 5, 6), None, dc.DamchaValueError, r"^Invalid argument `query`: expected rank 3"),
        ((2, 0, 8), (2, 5, 6), (2, 1, 1, 4), dc.DamchaValueError, r"^Invalid argument `mask`: expected a shape broadcastable to \(B, H, N, M\) = \(2, 2, 0, 5\)"),
        ((0, 3, 8), (0, 5, 6), (0, 3, 5), dc.DamchaValueError, r"pass mask\[:, None\]\)\. Received: mask\.shape=\(0, 3, 5\)$"),
    ],
    ids=["M0-refused", "B0-M0-refused", "B0-query-features", "B0-context-features", "B0-batch-mismatch",
         "B0-rank", "N0-mask-keys", "B0-mask-3d"],
)
# fmt: on
def test_empty_inputs_are_checked_as_strictly(query, context, mask, error, pattern) -> None:
    m = None if mask is None else np.ones(mask, bool)
    with pytest.raises(error, match=pattern):
        dc.damcha_attention(_params(CROSS), CROSS, np.zeros(query), np.zeros(context), mask=m)
