"""Tolerances, declared once per dtype, for every comparison against the reference."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|x - ref| <= atol + rtol * |ref|`` elementwise for outputs; for a
    directional derivative along a random unit direction,
    ``|dd - dd_ref| <= grad_atol + grad_rtol * rms(grad)`` with
    ``rms(grad) = ||grad|| / sqrt(grad.size)``.

    A random unit direction sees ``1/sqrt(size)`` of any vector: both the
    port's ``dd`` (about ``rms(grad)``) and its error (about ``rms(grad -
    grad_ref)``). So the rule asks for a relative gradient error of about
    ``grad_rtol``, whatever the tensor's size. (Scaling by ``||grad||`` instead
    would allow ``grad_rtol * sqrt(size)``: a negated bfloat16 gradient of any
    tensor over ~100 entries passed.)"""

    rtol: float
    atol: float
    grad_rtol: float
    grad_atol: float

    def output_ratio(self, actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
        """(max abs error, worst error / allowed); the check passes when the ratio <= 1."""
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        if actual.shape != expected.shape:
            return float("inf"), float("inf")
        finite = np.isfinite(expected)
        # NaN in gives NaN out: non-finite exactly where the reference is (a port that zeroes a
        # NaN row, or makes a finite row NaN, fails); the finite entries within tolerance.
        if not np.array_equal(np.isfinite(actual), finite):
            return float("nan"), float("inf")
        err = np.abs(actual - expected)[finite]
        allowed = (self.atol + self.rtol * np.abs(expected))[finite]
        return float(err.max(initial=0.0)), float((err / allowed).max(initial=0.0))

    def grad_ratio(self, dd: float, dd_ref: float, grad_rms: float) -> tuple[float, float]:
        """(|dd - dd_ref|, that over its allowance); ``grad_rms`` is the port's
        ``||grad|| / sqrt(grad.size)``. A non-finite dd or gradient is ratio inf."""
        if not (np.isfinite(dd) and np.isfinite(grad_rms)):
            return float("nan"), float("inf")
        err = abs(dd - dd_ref)
        return err, err / (self.grad_atol + self.grad_rtol * grad_rms)


# Outputs are O(1) by construction of the catalogue. float64 is limited by
# summation order; float32 by ~1e-7 eps over a few chained einsums; the 16-bit
# types by their 8 (bfloat16) and 11 (float16) bit mantissas. Gradient
# tolerances are looser: the float64 reference's central differences carry
# ~1e-10 error, and low-precision backward passes accumulate more rounding.
# The 16-bit grad_atol is a floor for gradients that are ~0 in exact arithmetic
# (key biases: softmax ignores a shift of a query's logits); measured honest
# ports need < 2e-3 in bfloat16 on CPU, and the median |dd| of the catalogue
# is ~0.09, so a larger floor would let wrong gradients of many tensors pass.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-9, atol=1e-10, grad_rtol=1e-6, grad_atol=1e-7),
    "float32": Tolerance(rtol=2e-4, atol=2e-5, grad_rtol=2e-3, grad_atol=2e-4),
    "float16": Tolerance(rtol=1e-2, atol=1e-2, grad_rtol=5e-2, grad_atol=2e-2),
    "bfloat16": Tolerance(rtol=5e-2, atol=5e-2, grad_rtol=2e-1, grad_atol=2e-2),
}

DTYPES = tuple(TOLERANCES)


def tolerance(dtype: str) -> Tolerance:
    """The tolerance of ``dtype`` (one of ``DTYPES``)."""
    from damcha_core import DamchaValueError, invalid_argument

    if dtype not in TOLERANCES:
        raise DamchaValueError(invalid_argument("dtype", f"one of {DTYPES}", f"dtype={dtype!r}"))
    return TOLERANCES[dtype]
