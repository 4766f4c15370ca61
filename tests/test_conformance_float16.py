"""The float16-only large-activation cases: a float16 port must take phi's statistic in at least
float32 (spec section 7). Before them such a port failed only where some other case's rounding
happened to exceed the tolerance; now it fails these cases by far, and only these."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _conformance_fixtures import Float16NoUpcast, Float16Upcast

import damcha_conformance as dcf
import damcha_core as dc
from damcha_conformance.pytest_plugin import checks

LARGE_CASES = [c for c in dcf.CATALOGUE if c.inputs == "large"]
ONLY = dict(errors=False, decoding=False, weights=False, penalty=False)


def test_large_tokens_overflow_a_float16_square_and_the_reference_stays_finite():
    assert {c.config.metric for c in LARGE_CASES} == {"heads", "lowrank"}
    assert all(c.dtypes == ("float16",) for c in LARGE_CASES)
    assert {c.config.coupling for c in LARGE_CASES} == {"tied", "separate"}
    for case in LARGE_CASES:
        data = dcf.materialise(case)
        for tokens in (data.query, data.context):
            if tokens is None:
                continue
            half = tokens.astype(np.float16)
            assert np.isfinite(half).all()
            with np.errstate(over="ignore"):
                # Every token's float16 statistic is inf (phi would be 0 for all of them) ...
                assert np.isinf(np.mean(half * half, axis=-1)).all(), case.name
            # ... while phi (scale-free) sees ordinary tokens: the generator is exercised as usual.
            assert np.allclose(dc.rms_normalise(tokens), dc.rms_normalise(tokens / dcf.LARGE))
        # q, k, v and the output stay O(1) (kernels scaled down as much as the tokens are up), and
        # the float64 output rounded to float16 is finite: an honest float16 port can match it.
        assert 0.5 < np.abs(data.expected).max() < 10 and np.isfinite(data.expected.astype(np.float16)).all()


def test_a_float16_port_without_the_upcast_fails_exactly_the_large_token_cases():
    report = dcf.run_conformance(Float16NoUpcast(), **ONLY)
    failed = {r.case: r for r in report.failures()}
    # Every other float16 case passes it: ordinary tokens never reach |t| = 256.
    assert set(failed) == {c.name for c in LARGE_CASES}, report.summary()
    # Deterministically: off by far more than the tolerance (phi = 0, not rounding).
    assert all(r.ratio > 20 for r in failed.values()), report.summary()
    # The same port squaring in float32 passes them, by a wide margin.
    honest = dcf.run_conformance(Float16Upcast(), cases=LARGE_CASES, **ONLY)
    assert honest.passed and all(r.ratio < 0.5 for r in honest.results), honest.summary()


def test_the_large_token_cases_run_in_float16_only():
    class Wide(dcf.ReferenceAdapter):
        name, dtypes = "wide", ("float64", "float16")

        def forward(self, data, dtype):
            return super().forward(data, dtype).astype(dtype)

    report = dcf.run_conformance(Wide(), cases=LARGE_CASES, gradients=False, **ONLY)
    assert [(r.case, r.dtype) for r in report.results] == [(c.name, "float16") for c in LARGE_CASES]
    planned = {(c.case.name, c.dtype) for c in checks(["float32", "float16"]) if c.kind == "forward"}
    assert all((c.name, "float16") in planned and (c.name, "float32") not in planned for c in LARGE_CASES)


@pytest.mark.parametrize("dtypes", [("fp16",), ["float16"], ()], ids=["unknown", "a-list", "empty"])
def test_a_case_s_dtypes_must_be_a_tuple_of_known_dtypes(dtypes):
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `dtypes`: expected None or a non-empty tuple"):
        dataclasses.replace(LARGE_CASES[0], dtypes=dtypes)
