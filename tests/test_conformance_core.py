"""The conformance core: the catalogue spans the spec, the runner catches wrong
ports, the golden file pins the reference, and exported vectors let a foreign
implementation check itself."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from _naive import naive_damcha
from safetensors.numpy import load_file

import damcha_conformance as dcf
import damcha_core as dc
from damcha_conformance import _golden


def test_catalogue_spans_the_required_features():
    cases = dcf.CATALOGUE
    cfgs = [c.config for c in cases]
    assert {c.metric for c in cfgs} == {"heads", "lowrank", "none"}
    assert {c.coupling for c in cfgs if c.metric != "none"} == {"tied", "separate", "query"}
    assert any(c.num_kv_heads == c.num_heads for c in cfgs)  # MHA
    assert any(1 < c.num_kv_heads < c.num_heads for c in cfgs)  # GQA
    assert any(c.num_kv_heads == 1 for c in cfgs)  # MQA
    assert any(c.self_attention for c in cases)
    assert any(
        not c.self_attention and c.context_len != c.query_len and c.config.context_dim != c.config.query_dim
        for c in cases
    )
    assert {c.config.use_bias for c in cases} == {True, False}
    assert {c.mask for c in cases} >= {None, "padding", "per_head", "all_masked_row"}
    causal = [c for c in cases if c.causal]
    lens = [(c.query_len, c.query_len if c.self_attention else c.context_len) for c in causal]
    assert any(n == m for n, m in lens) and any(n < m for n, m in lens) and any(n > m for n, m in lens)
    assert {c.batch for c in cases} >= {1, 2}
    assert any(c.query_len >= 512 for c in cases)
    assert any(c.config.scale is not None for c in cases)
    assert any(c.config.metric_rank == 1 for c in cases)
    assert any(c.config.value_dim != c.config.key_dim and c.config.output_dim != c.config.query_dim for c in cases)
    # cross-attention whose context could pass for the query (same length and features),
    # tied and separate: a port feeding the query tokens to the key-side map must fail
    same = {
        c.config.coupling
        for c in cases
        if not c.self_attention
        and c.context_len == c.query_len
        and c.config.context_dim == c.config.query_dim
        and c.config.metric != "none"
    }
    assert same >= {"tied", "separate"}
    assert {c.config.metric for c in cases if c.inputs == "small-and-zero"} >= {"heads", "lowrank"}
    # value tokens of their own feature size (E_v != E_kv): torch kdim != vdim, Keras key/value, Flax inputs_v
    value_cases = [c for c in cases if c.separate_value]
    assert value_cases and all(
        c.config.value_input_dim not in (c.config.context_dim, c.config.query_dim) for c in value_cases
    )
    data = dcf.materialise(next(c for c in cases if c.mask == "all_masked_row"))
    assert np.any(~np.any(data.mask, axis=-1)), "the all-masked-row case must hide every key from some query"


def test_case_params_open_every_gate():
    for case in dcf.CATALOGUE:
        p = dcf.materialise(case).params
        for side in case.config.metric_sides:
            assert np.all(np.abs(p[f"metric.{side}.gate"]) >= 0.3)


def test_reference_passes_through_the_runner():
    report = dcf.run_conformance(dcf.ReferenceAdapter())
    assert report.passed, report.summary()
    in_float64 = [c for c in dcf.CATALOGUE if c.runs_in("float64")]  # not the float16-only cases
    checks = (dcf.ERROR_CATALOGUE, dcf.DECODE_CATALOGUE, dcf.WEIGHTS_CASES, dcf.PENALTY_CASES)
    assert len(report.results) == len(in_float64) + sum(map(len, checks))
    rejects = [r for r in report.results if r.check == "rejects"]
    assert len(rejects) == len(dcf.ERROR_CATALOGUE) and all("DamchaValueError" in r.detail for r in rejects)


def test_golden_file_pins_the_reference():
    frozen = _golden.load()
    expected_keys = set()
    for case in dcf.CATALOGUE:
        for key, value in _golden.golden_entries(case).items():
            expected_keys.add(key)
            # The directional derivatives are central differences: they divide the
            # loss's rounding error by 2e-5, so another CPU's BLAS kernels move them
            # (the file was frozen on an Intel Xeon; an AMD EPYC reads them up to
            # 3.6e-11 apart, its outputs 1.6e-15). A drifted reference moves them
            # by orders of magnitude more; the outputs keep the tight bound.
            atol = 1e-8 if key.endswith("/directional") else 1e-12
            np.testing.assert_allclose(value, frozen[key], rtol=1e-10, atol=atol, err_msg=key)
    assert expected_keys == set(frozen), "golden file and catalogue disagree on cases"


def _rounded(y, dtype):
    """``y`` rounded to ``dtype`` (a bfloat16 one as ``ml_dtypes.bfloat16``), as a port computing in
    float64 and rounding its results would return it. The fixtures below declaring float32 or a 16-bit
    dtype do so, so that they fail (or pass) for their deliberate bug, not the precision check (which
    cannot tell this rounding from computing in ``dtype``: docs/conformance.md)."""
    if dtype == "float64":
        return y
    import ml_dtypes

    return np.asarray(y).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def _reference_with(data, **replaced):
    """The reference output of the adapter's ``data`` with some of ``params``, ``query``, ``context``
    and ``value`` replaced (the adapter's object no longer has ``reference()``)."""
    get = lambda name: replaced.get(name, getattr(data, name))  # noqa: E731
    return dc.damcha_attention(
        get("params"), data.config, get("query"), get("context"), mask=data.mask, causal=data.causal, value=get("value")
    )


class _Wrong(dcf.ReferenceAdapter):
    """A port with one deliberate bug, to prove the runner can fail."""

    dtypes = ("float64", "float32")

    def __init__(self, bug):
        self.bug = bug
        self.name = f"wrong-{bug}"

    def forward(self, data, dtype):
        return _rounded(self._forward(data, dtype), dtype)

    def decode(self, data, dtype):
        return _rounded(super().decode(data, dtype), dtype)

    def weights(self, data, dtype):
        return _rounded(super().weights(data, dtype), dtype)

    def _forward(self, data, dtype):
        if self.bug == "ignores-metric":
            cfg = data.config.replace(metric="none", metric_rank=None)
            p = {k: v for k, v in data.params.items() if not k.startswith("metric.")}
            return dc.damcha_attention(p, cfg, data.query, data.context, mask=data.mask, causal=data.causal)
        if self.bug == "nan-masked-rows":
            y = super().forward(data, dtype)
            if data.mask is not None:
                y[~np.any(data.mask, axis=(1, 3))] = np.nan
            return y
        if self.bug == "no-causal":
            return dc.damcha_attention(data.params, data.config, data.query, data.context, mask=data.mask)
        if self.bug == "crash":
            raise RuntimeError("boom")
        if self.bug == "float32-rounding":
            return super().forward(data, dtype).astype(np.float32)
        raise AssertionError(self.bug)


@pytest.mark.parametrize(
    "bug, failing_groups",
    [
        ("ignores-metric", {"heads", "lowrank"}),
        ("nan-masked-rows", {"masks"}),
        ("no-causal", {"causal"}),
        ("crash", {"mha"}),
    ],
)
def test_runner_catches_a_wrong_port(bug, failing_groups):
    report = dcf.run_conformance(_Wrong(bug))
    assert not report.passed
    failed = {r.group for r in report.failures()}
    assert failing_groups <= failed
    if bug == "crash":
        assert all(
            r.status == "error" and "RuntimeError: boom" in r.detail
            for r in report.results
            if r.check in ("output", "gradients")
        )
        # boom is not a clear error about the bad input either
        assert all(
            r.status == "fail" and "RuntimeError: boom" in r.detail for r in report.results if r.check == "rejects"
        )


def test_error_catalogue_covers_every_corruption_and_each_differs_from_its_base():
    assert {c.corruption for c in dcf.ERROR_CATALOGUE} == set(dcf.CORRUPTIONS)
    for case in dcf.ERROR_CATALOGUE:
        bad, good = dcf.materialise_error(case), dcf.materialise(case.base)
        changed = [n for n in ("query", "context", "value", "mask") if getattr(bad, n) is not getattr(good, n)]
        assert changed == [case.argument], (case.name, changed)
        assert getattr(bad, case.argument).shape != getattr(good, case.argument).shape


class _Lenient(dcf.ReferenceAdapter):
    """Ports that mishandle bad input: fit it silently, or raise an unhelpful error."""

    def __init__(self, flaw):
        self.flaw, self.name = flaw, f"lenient-{flaw}"

    def forward(self, data, dtype):
        valid = dcf.materialise(data.case)  # what the port quietly makes of any input
        if self.flaw == "fits-input":
            return super().forward(valid, dtype)
        if self.flaw == "vague-error":
            if any(getattr(data, n) is not getattr(valid, n) for n in ("query", "context", "value", "mask")):
                raise ValueError("shape mismatch")
            return super().forward(data, dtype)
        wrong = [
            n
            for n in ("query", "context", "value", "mask")
            if getattr(getattr(data, n), "shape", None) != getattr(getattr(valid, n), "shape", None)
        ]
        if not wrong:
            return super().forward(data, dtype)
        shape = getattr(data, wrong[0]).shape
        message = {
            # A port's own clear wording passes (the rule asked for backticks or name= and "received").
            "own-words": f"Invalid {wrong[0]}: expected another shape, got {shape}",
            "names-only": f"`{wrong[0]}` has the wrong shape",
            "received-only": f"bad shape; received {shape}",
        }[self.flaw]
        raise ValueError(message)


@pytest.mark.parametrize(
    "flaw, lacks",
    [("own-words", None), ("names-only", "say what it received"), ("received-only", "name ")],
)
def test_error_rule_reads_the_ports_own_words(flaw, lacks):
    report = dcf.run_conformance(_Lenient(flaw), cases=[])
    rejects = [r for r in report.results if r.check == "rejects"]
    assert len(rejects) == len(dcf.ERROR_CATALOGUE)
    if lacks is None:
        assert all(r.status == "pass" for r in rejects), report.summary()
    else:
        assert all(r.status == "fail" and f"message must {lacks}" in r.detail for r in rejects), report.summary()
        assert all(" and " not in r.detail.split(":")[0] for r in rejects)  # only what it lacks


@pytest.mark.parametrize("flaw", ["fits-input", "vague-error"])
def test_runner_fails_ports_that_accept_bad_input_or_reject_it_vaguely(flaw):
    report = dcf.run_conformance(_Lenient(flaw), cases=[])
    rejects = [r for r in report.results if r.check == "rejects"]
    assert len(rejects) == len(dcf.ERROR_CATALOGUE)
    assert not report.passed
    if flaw == "fits-input":
        assert all(r.status == "fail" and "bad input accepted" in r.detail for r in rejects), report.summary()
    else:
        failed = {r.case.split(":")[0] for r in rejects if r.status == "fail"}
        assert failed == set(dcf.CORRUPTIONS), report.summary()
        assert all("must name" in r.detail for r in rejects)


class _Slicing(dcf.ReferenceAdapter):
    """Takes the part of each tensor it needs: value[:B, :M, :E_v] and mask[:B, :, :N] (a port
    written for cache-style masks), so the output of a valid call is right."""

    name = "slicing"

    def forward(self, data, dtype):
        B, N = data.query.shape[-3], data.query.shape[-2]
        M = (data.query if data.context is None else data.context).shape[1]
        value = None if data.value is None else data.value[:B, :M, : data.config.value_input_dim]
        mask = None if data.mask is None else data.mask[:B, :, :N]
        return super().forward(dataclasses.replace(data, value=value, mask=mask), dtype)


def test_a_port_that_slices_value_tokens_or_mask_rows_fails_the_bad_input_checks():
    # The catalogue used to corrupt neither the separate value tokens nor the mask's batch and
    # query axes: this port passed every check while refusing none of them.
    report = dcf.run_conformance(_Slicing(), cases=[], decoding=False)
    failed = {r.case.split(":")[0]: r.detail for r in report.failures()}
    # value-batch too (value[:B] of B + 1 rows); value-batch-one is refused by the reference it calls.
    assert set(failed) == {"value-features", "value-length", "value-batch", "mask-queries", "mask-batch"}, (
        report.summary()
    )
    assert all("bad input accepted" in d for d in failed.values()), failed
    assert dcf.run_conformance(_Slicing(), cases=[dcf.CATALOGUE[0]], errors=False, decoding=False).passed


def test_errors_can_be_switched_off_or_narrowed():
    none = dict(decoding=False, weights=False, penalty=False)
    assert dcf.run_conformance(dcf.ReferenceAdapter(), cases=[], errors=False, **none).results == []
    only = dcf.run_conformance(dcf.ReferenceAdapter(), cases=[], errors=dcf.ERROR_CATALOGUE[:2], **none)
    assert [r.case for r in only.results] == [c.name for c in dcf.ERROR_CATALOGUE[:2]]
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `corruption`: expected one of .*Received: corruption='typo'"
    ):
        dcf.ErrorCase("x", dcf.CATALOGUE[0], "typo")


def test_float32_rounding_fails_float64_tolerance_but_passes_float32():
    cases = dcf.catalogue(groups=["heads"])
    assert not dcf.run_conformance(_Wrong("float32-rounding"), cases, ["float64"]).passed
    assert dcf.run_conformance(_Wrong("float32-rounding"), cases, ["float32"]).passed


class _FiniteDifferenceGradients(dcf.ReferenceAdapter):
    """Full gradients by per-element central differences of the reference (of the output's loss
    and of the metric penalty): an honest (slow) port for tiny cases, plus an optional deliberate
    error. Outputs, weights and gradients are rounded to the dtype asked for (``_rounded``)."""

    supports_gradients = True

    def __init__(self, scale=1.0, drop=None):
        self.scale, self.drop, self.name = scale, drop, "fd"

    def forward(self, data, dtype):
        return _rounded(super().forward(data, dtype), dtype)

    def weights(self, data, dtype):
        return _rounded(super().weights(data, dtype), dtype)

    def gradients(self, data, dtype):
        return {k: _rounded(g, dtype) for k, g in self._float64_gradients(data).items()}

    def metric_penalty_gradients(self, data, dtype):
        return {k: _rounded(g, dtype) for k, g in self._float64_gradients(data, penalty=True).items()}

    def _float64_gradients(self, data, penalty=False):
        def loss(**replaced):
            if penalty:
                get = lambda name: replaced.get(name, getattr(data, name))  # noqa: E731
                return dc.metric_penalty(get("params"), data.config, get("query"), get("context"), value=get("value"))
            return np.sum(_reference_with(data, **replaced) * data.cotangent)

        eps = 1e-6
        targets = {
            "query": data.query,
            **({} if data.context is None else {"context": data.context}),
            **({} if data.value is None else {"value": data.value}),
            **data.params,
        }
        grads = {}
        for name, base in targets.items():
            g = np.zeros_like(base)
            for idx in np.ndindex(base.shape):
                vals = []
                for sign in (1, -1):
                    moved = base.copy()
                    moved[idx] += sign * eps
                    if name in ("query", "context", "value"):
                        vals.append(loss(**{name: moved}))
                    else:
                        vals.append(loss(params={**data.params, name: moved}))
                g[idx] = (vals[0] - vals[1]) / (2 * eps)
            grads[name] = g * (self.scale if name == "metric.qk.gate" else 1.0)
        if self.drop:
            grads.pop(self.drop)
        return grads


TINY = dcf.Case("tiny", "heads", dc.DamchaConfig(query_dim=4, num_heads=2, key_dim=2), 1, 3, mask="per_head", seed=3)


def test_gradient_check_passes_correct_and_fails_wrong_gradients():
    ok = dcf.check_case(_FiniteDifferenceGradients(), TINY, "float64")
    assert [r.status for r in ok] == ["pass", "pass"], ok
    wrong = dcf.check_case(_FiniteDifferenceGradients(scale=1.01), TINY, "float64")
    assert wrong[1].status == "fail" and wrong[1].detail.startswith(
        "1 of 12 tensors outside the tolerance, worst: metric.qk.gate: "
    ), wrong
    missing = dcf.check_case(_FiniteDifferenceGradients(drop="key.bias"), TINY, "float64")
    assert missing[1].status == "error" and "key.bias" in missing[1].detail


# Separate coupling over a context of its own: the penalty reads the context through the keys' map.
TINY_CROSS = dcf.Case(
    "tiny-cross",
    "heads",
    dc.DamchaConfig(query_dim=4, num_heads=2, key_dim=2, coupling="separate", context_dim=3),
    1,
    3,
    2,
    seed=4,
)


class _PenaltyDetachesKeys(_FiniteDifferenceGradients):
    """Right penalty values, but the keys' role detached from the penalty's gradient (a port that
    builds the key side's generator input under no_grad or stop_gradient)."""

    def metric_penalty_gradients(self, data, dtype):
        grads = super().metric_penalty_gradients(data, dtype)
        return {**grads, "context": np.zeros_like(grads["context"])}


def test_penalty_gradient_check_passes_correct_and_fails_wrong_gradients():
    # The metric penalty's gradients were checked by no case: a port training with a wrong
    # regulariser gradient passed.
    for case in (TINY, TINY_CROSS):
        assert dcf.check_penalty(_FiniteDifferenceGradients(), case, "float64").status == "pass"
        assert dcf.check_penalty_gradients(_FiniteDifferenceGradients(), case, "float64").status == "pass"
    wrong = dcf.check_penalty_gradients(_FiniteDifferenceGradients(scale=1.01), TINY, "float64")
    assert wrong.status == "fail" and wrong.detail.startswith(
        "1 of 12 tensors outside the tolerance, worst: metric.qk.gate: "
    ), wrong
    detached = dcf.check_penalty_gradients(_PenaltyDetachesKeys(), TINY_CROSS, "float64")
    assert detached.status == "fail" and "worst: context" in detached.detail, detached
    assert detached.detail.endswith("(its gradient is all zero: is it detached from the penalty?)"), detached
    missing = dcf.check_penalty_gradients(_FiniteDifferenceGradients(drop="key.bias"), TINY, "float64")
    assert missing.status == "error" and "metric_penalty_gradients(data, dtype) must return" in missing.detail


class _WritesInPlace(_FiniteDifferenceGradients):
    """Returns the right values, then writes into an array it was given, as an in-place op on
    ``torch.from_numpy(data.query)`` (which shares the array's memory) does."""

    def __init__(self, target, step):
        super().__init__()
        self.target, self.step, self.name = target, step, f"writes-{target}"

    def _write(self, data, step):
        if step == self.step:
            array = data.params["metric.qk.gate"] if self.target == "params" else getattr(data, self.target)
            if array.dtype == bool:
                np.logical_not(array, out=array)  # mask.logical_not_() on a shared tensor
            else:
                array *= 1.001

    def forward(self, data, dtype):
        out = super().forward(data, dtype)
        self._write(data, "forward")
        return out

    def gradients(self, data, dtype):
        grads = super().gradients(data, dtype)
        self._write(data, "gradients")
        return grads

    def decode(self, data, dtype):
        out = super().decode(data, dtype)
        self._write(data, "decode")
        return out


@pytest.mark.parametrize(
    "target, step",
    [("query", "forward"), ("mask", "forward"), ("params", "forward"), ("cotangent", "gradients"), ("query", "decode")],
)
def test_a_port_that_writes_into_its_inputs_fails_and_the_catalogue_is_left_intact(target, step):
    # The adapter used to get the cached arrays of materialise() themselves: a write passed its own check and
    # changed what every later check (other dtypes, other adapters in the process) compared against.
    if step == "decode":
        case = dcf.DecodeCase("tiny-decode-writes", TINY.config, 1, 2, 2, seed=5)
        pristine = dcf.materialise_decode(case)
        before = {"query": pristine.query.copy()}
        result = dcf.check_decode(_WritesInPlace(target, step), case, "float64")
        assert result.status == "fail" and "wrote into data.query in place" in result.detail, result
        assert np.array_equal(dcf.materialise_decode(case).query, before["query"])
        assert dcf.check_decode(dcf.ReferenceAdapter(), case, "float64").status == "pass"
        return
    case = dataclasses.replace(TINY, name=f"tiny-writes-{target}", seed=11)  # a cache entry of its own
    pristine = dcf.materialise(case)
    before = {n: getattr(pristine, n).copy() for n in ("query", "mask", "cotangent", "expected")}
    before["params"] = {k: v.copy() for k, v in pristine.params.items()}
    results = dcf.check_case(_WritesInPlace(target, step), case, "float64")
    named = "data.params['metric.qk.gate']" if target == "params" else f"data.{target}"
    by_check = {r.check: r for r in results}
    wrote = by_check["output" if step == "forward" else "gradients"]
    assert wrote.status == "fail" and f"wrote into {named} in place" in wrote.detail, results
    assert all(r.status == "pass" for r in results if r is not wrote), results
    after = dcf.materialise(case)
    assert all(np.array_equal(getattr(after, n), before[n]) for n in ("query", "mask", "cotangent", "expected"))
    assert all(np.array_equal(after.params[k], v) for k, v in before["params"].items())
    assert [r.status for r in dcf.check_case(_FiniteDifferenceGradients(), case, "float64")] == ["pass", "pass"]


def test_exported_vectors_let_a_foreign_port_check_itself(tmp_path):
    """The naive loop implementation stands in for a port in another language:
    it reads only the JSON and safetensors files."""
    names = ["heads-separate-per-head-cross", "lowrank-query-gqa-padding", "heads-tied-causal-wide"]
    from damcha_conformance._vectors import export_vectors

    export_vectors(tmp_path, dcf.catalogue(names))
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["cases"] == names and "True = may attend" in index["procedure"]
    for name in names:
        desc = json.loads((tmp_path / f"{name}.json").read_text())
        t = load_file(str(tmp_path / desc["tensors"]))
        cfg = dc.DamchaConfig.from_dict(desc["config"])
        params = {k[len("params.") :]: v for k, v in t.items() if k.startswith("params.")}
        assert set(params) == set(cfg.param_shapes())
        ctx = t.get("inputs.context")
        assert (ctx is None) == desc["self_attention"]
        y = naive_damcha(params, cfg, t["inputs.query"], ctx, mask=t.get("inputs.mask"), causal=desc["causal"])
        tol = desc["tolerances"]["float64"]
        assert np.all(np.abs(y - t["expected.output"]) <= tol["atol"] + tol["rtol"] * np.abs(t["expected.output"]))
        # gradients: the foreign port's own central differences along the stored directions
        dd = desc["gradients"]["directional_derivatives"]
        for target in ("query", "metric." + cfg.metric_sides[0] + ".gate"):
            direction = t[f"gradients.direction.{target}"]
            plus, minus = (_naive_loss(params, cfg, t, desc, target, s * direction) for s in (1e-5, -1e-5))
            assert (plus - minus) / 2e-5 == pytest.approx(dd[target], rel=1e-6, abs=1e-8)


def _naive_loss(params, cfg, t, desc, target, step):
    """sum(output * cotangent) of the naive loops with ``step`` added to ``target``
    (the query or a parameter), from the exported files alone."""
    query, ctx, mask = t["inputs.query"], t.get("inputs.context"), t.get("inputs.mask")
    if target == "query":
        out = naive_damcha(params, cfg, query + step, ctx, mask, desc["causal"])
    else:
        out = naive_damcha({**params, target: params[target] + step}, cfg, query, ctx, mask, desc["causal"])
    return np.sum(out * t["gradients.cotangent"])


def test_exported_decode_vectors_let_a_foreign_port_check_its_cache(tmp_path):
    """A foreign port reads a decode case from the files alone; here the naive loops
    run the prefix and the new tokens with an explicit query offset."""
    from damcha_conformance._vectors import export_vectors

    export_vectors(tmp_path, [], dcf.DECODE_CATALOGUE)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["cases"] == [c.name for c in dcf.DECODE_CATALOGUE] and "prefix_len" in index["procedure"]
    for name in index["cases"]:
        desc = json.loads((tmp_path / f"{name}.json").read_text())
        t = load_file(str(tmp_path / desc["tensors"]))
        cfg = dc.DamchaConfig.from_dict(desc["config"])
        params = {k[len("params.") :]: v for k, v in t.items() if k.startswith("params.")}
        P, x = desc["decode"]["prefix_len"], t["inputs.query"]
        assert x.shape[1] == P + desc["decode"]["new_len"] == P + t["expected.output"].shape[1]
        y = naive_damcha(params, cfg, x[:, P:], x, causal=True, query_offset=P)
        tol = desc["tolerances"]["float64"]
        assert np.all(np.abs(y - t["expected.output"]) <= tol["atol"] + tol["rtol"] * np.abs(t["expected.output"]))
        # The prefill's outputs: a causal pass over the prefix alone.
        prefill = t[desc["decode"]["prefill"]]
        y = naive_damcha(params, cfg, x[:, :P], causal=True)
        assert prefill.shape == y.shape and np.all(np.abs(y - prefill) <= tol["atol"] + tol["rtol"] * np.abs(prefill))


def test_exported_error_vectors_carry_the_bad_input_and_the_rule(tmp_path):
    """The bad-input cases were not exported: a port in another language could not check the
    "errors" group. Read from the files alone, each case's inputs are its base case's with one tensor
    corrupted as named, and the reference refuses them as the rule asks (a ValueError naming one of
    error.names and saying what it received)."""
    import re

    from damcha_conformance._vectors import export_vectors

    export_vectors(tmp_path, [], (), dcf.ERROR_CATALOGUE)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["cases"] == [] and len(index["error_cases"]) == len(dcf.ERROR_CATALOGUE)
    assert "error.names" in index["procedure"]
    for stem, case in zip(index["error_cases"], dcf.ERROR_CATALOGUE):
        desc = json.loads((tmp_path / f"{stem}.json").read_text())
        assert desc["name"] == case.name and ":" not in stem and desc["error"]["corruption"] == case.corruption
        t = load_file(str(tmp_path / desc["tensors"]))
        cfg = dc.DamchaConfig.from_dict(desc["config"])
        params = {k[len("params.") :]: v for k, v in t.items() if k.startswith("params.")}
        base = dcf.materialise(case.base)
        changed = [
            k
            for k in ("query", "context", "value", "mask")
            if t.get(f"inputs.{k}") is not None and t[f"inputs.{k}"].shape != getattr(base, k).shape
        ]
        assert changed == [desc["error"]["argument"]], (case.name, changed)
        with pytest.raises(ValueError) as info:
            dc.damcha_attention(
                params,
                cfg,
                t["inputs.query"],
                t.get("inputs.context"),
                value=t.get("inputs.value"),
                mask=t.get("inputs.mask"),
                causal=desc["causal"],
            )
        message = str(info.value)
        assert any(re.search(rf"(?<![A-Za-z0-9]){n}(?![A-Za-z0-9])", message) for n in desc["error"]["names"])
        assert re.search(r"\b(received|got)\b", message, re.IGNORECASE), message


def test_cli_reference_run_and_json(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "damcha_core._cli", "conform", "--backend", "reference", "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "reference" in proc.stdout and "PASSED" in proc.stdout
    report = dcf.Report.from_json(out.read_text())
    assert report.passed
    in_float64 = [c for c in dcf.CATALOGUE if c.runs_in("float64")]
    checks = (dcf.ERROR_CATALOGUE, dcf.DECODE_CATALOGUE, dcf.WEIGHTS_CASES, dcf.PENALTY_CASES)
    assert len(report.results) == len(in_float64) + sum(map(len, checks))


def test_cli_third_party_adapter_failure_exits_nonzero(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "damcha_core._cli",
            "conform",
            "--adapter",
            "_conformance_fixtures:WrongMask",
            "--group",
            "masks",
        ],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "wrong-mask" in proc.stdout


def test_cli_export_vectors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "damcha_core._cli", "conform", "--export-vectors", str(tmp_path), "--group", "long"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(
        ["index.json"] + [f"{c.name}.json" for c in dcf.catalogue(groups=["long"])]
    )
    # The whole catalogue: the bad-input cases too, listed apart from the cases a model runs.
    everything = tmp_path / "all"
    proc = subprocess.run(
        [sys.executable, "-m", "damcha_core._cli", "conform", "--export-vectors", str(everything)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    index = json.loads((everything / "index.json").read_text())
    assert len(index["error_cases"]) == len(dcf.ERROR_CATALOGUE)
    assert index["cases"] == [c.name for c in dcf.CATALOGUE] + [c.name for c in dcf.DECODE_CATALOGUE]


def test_case_rejects_unknown_mask_kind():
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `mask`: expected None or one of .*Received: mask='pading'"
    ):
        dcf.Case("typo", "masks", dc.DamchaConfig(query_dim=4, num_heads=2, key_dim=2), 1, 3, mask="pading")
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `inputs`: expected None or one of .*Received: inputs='small'"
    ):
        dcf.Case("typo", "masks", dc.DamchaConfig(query_dim=4, num_heads=2, key_dim=2), 1, 3, inputs="small")


def test_small_and_zero_inputs_hold_a_zero_token_and_tokens_near_the_rms_eps():
    case = dcf.catalogue(["heads-separate-cross-same-shape-small-tokens"])[0]
    data = dcf.materialise(case)
    for tokens in (data.query, data.context):
        assert np.all(tokens[0, 0] == 0)
        ms = np.mean(tokens[:, 1::2] ** 2, axis=-1)
        assert np.all(ms < 1e-4) and np.all(ms > 1e-7)
    assert np.all(np.isfinite(data.expected))


class _WrongMath(dcf.ReferenceAdapter):
    """The reference with one internal step replaced: a port whose bug only shows
    on some inputs. Each must fail at float32 tolerance on a catalogue case."""

    dtypes = ("float64", "float32")

    def __init__(self, bug):
        self.bug, self.name = bug, f"wrong-{bug}"

    def forward(self, data, dtype):
        from damcha_core import _reference as ref

        calls = []
        apply_map = ref.apply_map

        def patched_apply_map(params, config, side, tokens, y):
            calls.append(tokens)
            if self.bug == "key-map-from-query-tokens" and len(calls) == 2 and tokens.shape == calls[0].shape:
                tokens = calls[0]  # the key side's map driven by x instead of c
            if (
                self.bug == "key-side-uses-query-generator"
                and side == "k"
                and (params["metric.q.kernel"].shape == params["metric.k.kernel"].shape)
            ):
                side = "q"
            return apply_map(params, config, side, tokens, y)

        patches = {"apply_map": patched_apply_map}
        if self.bug == "rms-eps-1e-5":
            patches["RMS_EPS"] = 1e-5
        if self.bug == "rms-without-eps":  # t * rsqrt(mean(t^2)): NaN at a zero token
            patches["rms_normalise"] = lambda t: t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True))
        with mock.patch.multiple(ref, **patches), np.errstate(invalid="ignore", divide="ignore"):
            return _rounded(super().forward(data, dtype), dtype)


@pytest.mark.parametrize(
    "bug, caught_by",
    [
        ("key-map-from-query-tokens", {"heads-tied-cross-same-shape", "heads-separate-cross-same-shape-small-tokens"}),
        ("key-side-uses-query-generator", {"heads-separate-cross-same-shape-small-tokens"}),
        ("rms-eps-1e-5", {"heads-separate-cross-same-shape-small-tokens", "lowrank-tied-rank1-small-tokens"}),
        ("rms-without-eps", {"heads-separate-cross-same-shape-small-tokens", "lowrank-tied-rank1-small-tokens"}),
    ],
)
def test_catalogue_catches_bugs_that_only_some_inputs_reveal(bug, caught_by):
    report = dcf.run_conformance(_WrongMath(bug), dtypes=["float32"], errors=False)
    assert caught_by <= {r.case for r in report.failures()}, report.summary()


class _NegatedGradients(_FiniteDifferenceGradients):
    """Honest gradients, negated for every tensor of 64 entries or more."""

    def gradients(self, data, dtype):
        return {k: -g if g.size >= 64 else g for k, g in super().gradients(data, dtype).items()}


MID = dcf.Case("mid", "heads", dc.DamchaConfig(query_dim=16, num_heads=2, key_dim=4), 1, 3, seed=5)


def test_gradient_check_scales_with_the_rms_not_the_norm_of_the_gradient():
    """A random unit direction sees 1/sqrt(size) of a gradient, so an allowance of
    grad_rtol * ||grad|| let a negated bfloat16 gradient of any tensor over ~100
    entries pass; the rms keeps every dtype's check meaningful."""
    for dtype in ("float64", "bfloat16"):
        honest = dcf.check_case(_FiniteDifferenceGradients(), MID, dtype)
        assert [r.status for r in honest] == ["pass", "pass"], (dtype, honest)
    for dtype in ("float32", "float16", "bfloat16"):
        wrong = dcf.check_case(_NegatedGradients(), MID, dtype)
        assert wrong[1].status == "fail", (dtype, wrong)
    assert dcf.tolerance("bfloat16").grad_ratio(0.0, 0.03, 0.0)[1] > 1  # a zero gradient where dd_ref = 0.03


class _WrongDecoder(dcf.ReferenceAdapter):
    """Decoders with the classic cache bugs (each returns the decoded tokens' outputs alone, as
    adapters did before the prefill's were compared; "prefill-not-causal" returns every token's)."""

    def __init__(self, bug):
        self.bug, self.name = bug, f"decoder-{bug}"

    def decode(self, data, dtype):
        P, x = data.case.prefix_len, data.query
        if self.bug == "prefill-not-causal":  # the prompt read in one pass that lets it see its future
            prefill = dc.damcha_attention(data.params, data.config, x[:, :P])
            return np.concatenate([prefill, super().decode(data, dtype)[:, P:]], axis=1)
        if self.bug == "top-left":  # the new tokens' causal rule restarts at position 0
            return dc.damcha_attention(data.params, data.config, x[:, P:], x, causal=True)
        if self.bug == "forgets-prefix":  # the cache is not read
            return dc.damcha_attention(data.params, data.config, x[:, P:], causal=True)
        if self.bug == "no-causal":  # the chunk's tokens see each other's future
            return dc.damcha_attention(data.params, data.config, x[:, P:], x)
        raise AssertionError(self.bug)


@pytest.mark.parametrize("bug", ["top-left", "forgets-prefix", "no-causal"])
def test_decode_cases_catch_cache_bugs(bug):
    report = dcf.run_conformance(_WrongDecoder(bug), cases=[], errors=False)
    decode = [r for r in report.results if r.check == "decode"]
    assert len(decode) == len(dcf.DECODE_CATALOGUE) and not report.passed
    assert all(r.status == "fail" for r in decode), report.summary()


class _DecodedOnly(_WrongDecoder):
    """``_WrongDecoder`` returning the decoded tokens' outputs alone, (B, N, E_o), as adapters written
    before the prefill was compared do."""

    def decode(self, data, dtype):
        return super().decode(data, dtype)[:, data.case.prefix_len :]


def test_a_prefill_that_ignores_the_causal_rule_fails_once_its_outputs_are_returned():
    # The adapters returned the decoded tokens' outputs alone: a prefill that let the prompt see its
    # future (its outputs wrong, the cache it leaves right) passed every decode case, as it still does
    # in that older form, which is accepted, but as a gap: PARTIAL, not PASSED (it used to be PASSED,
    # the detail of passing results the only place that said the prefill went unchecked).
    old = dcf.run_conformance(_DecodedOnly("prefill-not-causal"), cases=[], errors=False, weights=False, penalty=False)
    assert old.passed and old.verdict == "PARTIAL", old.summary()
    assert all(r.status == "pass" and "prefill's outputs were not returned" in r.detail for r in old.results)
    [(_, gap)] = old.gaps
    assert gap.startswith(f"decode prefill: {len(dcf.DECODE_CATALOGUE)} decode cases (float64) returned"), gap
    assert "decode prefill:" in old.verdict_line()
    report = dcf.run_conformance(
        _WrongDecoder("prefill-not-causal"), cases=[], errors=False, weights=False, penalty=False
    )
    assert [r.status for r in report.results] == ["fail"] * len(dcf.DECODE_CATALOGUE), report.summary()
    # Only prefill rows are wrong: the worst element lies in the first P tokens.
    for result, case in zip(report.results, dcf.DECODE_CATALOGUE):
        worst = result.detail.split("worst at (b, n, e) = (", 1)[1]
        assert int(worst.split(", ")[1]) < case.prefix_len, result.detail
    # The reference, returning every token's outputs, passes with nothing unchecked.
    honest = dcf.run_conformance(dcf.ReferenceAdapter(), cases=[], errors=False, weights=False, penalty=False)
    assert honest.conformant and all(r.detail == "" for r in honest.results), honest.summary()


def test_an_adapter_without_decode_reports_the_cases_unsupported():
    class NoDecode:
        name, dtypes, supports_gradients = "no-decode", ("float64",), False
        unsupported = dcf.ReferenceAdapter.unsupported
        forward = dcf.ReferenceAdapter.forward

    report = dcf.run_conformance(NoDecode(), cases=[], errors=False, weights=False, penalty=False)
    assert [r.status for r in report.results] == ["unsupported"] * len(dcf.DECODE_CATALOGUE)
    assert all("no decode" in r.detail for r in report.results)


def test_decode_cases_expect_rows_of_one_causal_pass():
    """Independent of query_offset: the expected outputs are the last N rows of
    the naive loop implementation's causal pass over the whole sequence."""
    for case in dcf.DECODE_CATALOGUE:
        data = dcf.materialise_decode(case)
        full = naive_damcha(data.params, case.config, data.query, None, None, True)
        np.testing.assert_allclose(data.expected, full[:, case.prefix_len :], rtol=1e-10, atol=1e-12)
        assert case.config.value_dim == case.config.key_dim and case.new_len >= 2


def test_the_value_case_checks_the_values_and_their_gradient():
    """A port that feeds the key tokens (or nothing) as values cannot pass the
    E_v != E_kv case, and the gradient check covers the value input."""
    case = next(c for c in dcf.CATALOGUE if c.separate_value)
    data = dcf.materialise(case)
    assert data.value.shape == (case.batch, case.context_len, case.config.value_input_dim)
    assert "value" in dcf.gradient_targets(data) and "value" in dcf.reference_directional(case)
    assert dcf.check_case(dcf.ReferenceAdapter(), case, "float64")[0].status == "pass"

    class ValuesFromTheContext(dcf.ReferenceAdapter):
        def forward(self, data, dtype):  # the context's first E_v features as values: a silent slice
            value = data.context[..., : data.config.value_input_dim]
            return dc.damcha_attention(data.params, data.config, data.query, data.context, mask=data.mask, value=value)

    assert dcf.check_case(ValuesFromTheContext(), case, "float64")[0].status == "fail"
    grads = _FiniteDifferenceGradients()
    small = dcf.Case(
        "tiny-value",
        "shapes",
        dc.DamchaConfig(query_dim=4, num_heads=2, key_dim=2, coupling="separate", context_dim=3, value_input_dim=2),
        1,
        2,
        3,
        seed=7,
    )
    assert [r.status for r in dcf.check_case(grads, small, "float64")] == ["pass", "pass"]
    wrong = dcf.check_case(_FiniteDifferenceGradients(drop="value"), small, "float64")
    assert wrong[1].status == "error" and "value" in wrong[1].detail


class _Retyped(dcf.ReferenceAdapter):
    """Returns the right values in a dtype that is no real float (or adds an imaginary part)."""

    def __init__(self, how):
        self.how = how
        self.name = f"retyped-{how}"

    def forward(self, data, dtype):
        y = super().forward(data, dtype)
        if self.how == "complex":
            return y + 1e6j  # np.asarray(..., float64) used to drop the 1e6j: error 0, pass
        if self.how == "int":
            return y.astype(np.int64)
        return y.astype(np.float32)  # a real float32 output stays judged by the values


@pytest.mark.parametrize("how", ["complex", "int", "float32"])
def test_output_must_be_a_real_floating_array(how):
    [result] = dcf.check_case(_Retyped(how), TINY, "float64", gradients=False)
    if how == "float32":
        # float32 values cannot be float64 results, and float32 rounding misses float64's tolerance
        assert result.status == "fail" and "forward returned a float32 array, narrower than float64" in result.detail
        assert "elements outside the tolerance" in result.detail, result
        return
    assert result.status == "error", result
    assert (
        "must be a real floating array" in result.detail
        and f"Received: dtype {'complex128' if how == 'complex' else 'int64'}" in result.detail
    )


def test_outputs_are_judged_by_the_reference_s_own_real_float_rule():
    """The runner had its own copy of damcha_core's rule; both must agree on every dtype,
    bfloat16 (no np.floating subtype) and float8 (ml_dtypes: not a real float here) included."""
    import ml_dtypes

    from damcha_conformance._runner import _real_float64
    from damcha_core._params import is_real_float

    dtypes = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]
    dtypes += [np.int64, np.bool_, np.complex64]
    for dtype in dtypes:
        value = np.ones((2, 3), dtype=dtype)
        accepted = is_real_float(value.dtype)
        assert accepted == (dtype in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)), dtype
        if accepted:
            np.testing.assert_array_equal(_real_float64(value, "the output"), np.ones((2, 3)))
        else:
            with pytest.raises(TypeError, match="the output must be a real floating array"):
                _real_float64(value, "the output")
        # The reference's own inputs follow the same rule.
        config = dc.DamchaConfig(query_dim=3, num_heads=1, key_dim=3)
        params = dc.init_params(config, seed=0)
        x = np.ones((1, 2, 3), dtype=dtype)
        if accepted:
            dc.damcha_attention(params, config, x)
        else:
            with pytest.raises(dc.DamchaTypeError, match="expected a real floating tensor"):
                dc.damcha_attention(params, config, x)


class _OffAt(dcf.ReferenceAdapter):
    """The reference's output, wrong at one place: NaN in query row 1 of batch 0 (what a port
    that divides by a zero softmax sum returns for a row that sees no key), or one element off."""

    def __init__(self, how):
        self.how, self.name = how, f"off-{how}"

    def forward(self, data, dtype):
        y = super().forward(data, dtype).copy()
        if self.how == "nan-row":
            y[0, 1, :] = np.nan
        else:
            y[1, 2, 3] += 1e-3
        return y


def test_a_failed_output_says_where_and_what():
    # The line used to be "FAIL off-nan-row/float64 tiny [output] err=nan ratio=inf" and nothing more.
    case = dataclasses.replace(TINY, batch=2, query_len=4, name="tiny-off-at")
    [nan] = dcf.check_case(_OffAt("nan-row"), case, "float64", gradients=False)
    assert nan.status == "fail" and nan.detail.startswith(
        "4 non-finite values (NaN or inf) where the reference is finite, in 1 query rows"
    ), nan
    assert "first at (b, n, e) = (0, 1, 0)" in nan.detail, nan
    [off] = dcf.check_case(_OffAt("one"), case, "float64", gradients=False)
    expected = dcf.materialise(case).expected[1, 2, 3]
    assert off.status == "fail" and off.detail.startswith("1 of 32 elements outside the tolerance"), off
    assert f"worst at (b, n, e) = (1, 2, 3): {expected + 1e-3:.6g}, expected {expected:.6g}" in off.detail, off


def test_cases_may_be_named_as_the_cli_names_them():
    # run_conformance(cases=["heads-tied-self"]) raised AttributeError: 'str' object has no attribute 'gradients'.
    names = ["mha-none-self", "heads-tied-self"]
    by_name = dcf.run_conformance(
        dcf.ReferenceAdapter(),
        names,
        ("float64",),
        errors=False,
        decoding=False,
        weights=False,
        penalty=False,
    )
    by_case = dcf.run_conformance(
        dcf.ReferenceAdapter(),
        [c for c in dcf.CATALOGUE if c.name in names],
        ("float64",),
        errors=False,
        decoding=False,
        weights=False,
        penalty=False,
    )
    assert [(r.case, r.check, r.status) for r in by_name.results] == [
        (r.case, r.check, r.status) for r in by_case.results
    ]
    assert {r.case for r in by_name.results} == set(names) and by_name.passed
    from damcha_conformance.pytest_plugin import checks

    assert [
        (c.kind, c.case.name)
        for c in checks(("float64",), cases=names, decoding=False, errors=False, weights=False, penalty=False)
    ] == [
        (c.kind, c.case.name)
        for c in checks(
            ("float64",),
            cases=[c for c in dcf.CATALOGUE if c.name in names],
            decoding=False,
            errors=False,
            weights=False,
            penalty=False,
        )
    ]
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `cases\[1\]`: expected the name of one of the \d+ Cases it takes\. Received: 'no-such-case'",
    ):
        dcf.run_conformance(dcf.ReferenceAdapter(), ["mha-none-self", "no-such-case"])
    with pytest.raises(
        dc.DamchaTypeError, match=r"`cases`: .*Received: cases='heads-tied-self' \(one string, read letter by letter\)"
    ):
        dcf.run_conformance(dcf.ReferenceAdapter(), "heads-tied-self")
    with pytest.raises(dc.DamchaTypeError, match=r"`cases\[0\]`: expected a Case or its name\. Received: 3"):
        checks(("float64",), cases=[3])
    for call in (lambda: dcf.run_conformance(dcf.ReferenceAdapter(), dtypes="float64"), lambda: checks("float64")):
        with pytest.raises(
            dc.DamchaTypeError, match=r"`dtypes`: .*Received: dtypes='float64' \(one string, read letter by letter\)"
        ):
            call()


class _Quiet(dcf.ReferenceAdapter):
    """The reference's output with its NaN rows zeroed (what a kernel that guards
    every row with no visible key does, here to a row NaN by its own token)."""

    name = "quiet"

    def forward(self, data, dtype):
        return np.nan_to_num(super().forward(data, dtype), nan=0.0)


def test_a_quiet_port_is_told_where_it_dropped_the_nan():
    # Read "0 of 160 elements outside the tolerance, worst ...: 0, expected nan" (a reviewer's repro).
    case = next(c for c in dcf.CATALOGUE if c.name == "heads-separate-nan-token-cross")
    [quiet] = dcf.check_case(_Quiet(), case, "float64", gradients=False)
    assert quiet.status == "fail", quiet
    assert quiet.detail.startswith(
        "16 finite values where the reference is NaN or inf (NaN in must give NaN out), in 1 query rows"
    ), quiet
    assert "first at (b, n, e) = (0, 1, 0): 0, expected nan" in quiet.detail, quiet


class _GradientsReturnNothing(dcf.ReferenceAdapter):
    """The doc's adapter with the body of ``gradients`` left as ``...``."""

    supports_gradients = True

    def gradients(self, data, dtype): ...


def test_gradients_that_are_not_a_mapping_are_named():
    # Used to read "TypeError: 'NoneType' object is not iterable at _runner.py:221".
    [_, result] = dcf.check_case(_GradientsReturnNothing(), TINY, "float64")
    assert result.status == "error" and "gradients(data, dtype) must return a mapping" in result.detail, result
    assert "Received: None" in result.detail, result


class _ZeroGradient(_FiniteDifferenceGradients):
    """A port whose query-side gate is detached from the output: its gradient is all zero."""

    def gradients(self, data, dtype):
        grads = super().gradients(data, dtype)
        grads["metric.qk.gate"] = np.zeros_like(grads["metric.qk.gate"])
        return grads


def test_a_failed_gradient_check_gives_the_derivatives_and_says_when_a_gradient_is_zero():
    # The detail used to be "worst: metric.qk.gate" alone.
    [_, result] = dcf.check_case(_ZeroGradient(), TINY, "float64")
    _, dd_ref = dcf.reference_directional(TINY)["metric.qk.gate"]
    assert result.status == "fail", result
    assert f"worst: metric.qk.gate: directional derivative 0, reference {dd_ref:.6g}" in result.detail, result
    assert "its gradient is all zero: is it detached from the output?" in result.detail, result


class _PickyUnsupported(dcf.ReferenceAdapter):
    """Declares per-head masks unsupported by reading ``case.mask``, and its ``unsupported``
    crashes on the causal cases."""

    name = "picky"

    def unsupported(self, case):
        if case.causal and not case.self_attention:
            raise RuntimeError("causal cross-attention: not thought about")
        return "per-head masks not yet" if case.mask == "per_head" else None


def test_unsupported_that_raises_is_an_error_of_that_check_not_the_end_of_the_run():
    # A raise in unsupported() used to end run_conformance (the CLI's worker died, every result lost), and a
    # DecodeCase had no .mask, so the adapter above crashed on the decode group.
    report = dcf.run_conformance(_PickyUnsupported())
    by_case = {(r.case, r.check): r for r in report.results}
    wide = by_case[("heads-tied-causal-wide", "output")]
    assert wide.status == "error" and "unsupported(case) raised RuntimeError: causal cross-attention" in wide.detail
    assert by_case[("heads-separate-per-head-cross", "output")].status == "unsupported"
    assert all(r.status == "pass" for r in report.results if r.group == "decode"), report.summary()
    assert by_case[("heads-tied-self", "output")].status == "pass"


# ---------------------------------------------------------------- declared precision


def _in_float32():
    """Patches that make the reference's own code compute in float32: its inputs and validated
    params are cast to float32 instead of float64 (every later step keeps its operands' dtype)."""
    from damcha_core import _reference as ref

    validate = ref.validate_params
    return mock.patch.multiple(
        ref,
        _as_float64=lambda name, value: np.asarray(value).astype(np.float32),
        validate_params=lambda params, config: {k: v.astype(np.float32) for k, v in validate(params, config).items()},
    )


class _Precision(dcf.ReferenceAdapter):
    """Declares ``declared`` and returns the reference's values computed (or rounded) as ``how`` says:

    - "float64": computed in float64 and returned as such, whatever was declared (the planted bug);
    - "float32": computed in float32 (the reference's code, patched), returned as a float32 array;
    - "float32-as-float64": the same float32 results, up-cast to float64 before returning (as the
      built-in adapters return theirs);
    - "rounded" / "rounded-as-float32": the float64 values rounded to ``declared`` (bfloat16 as
      ``ml_dtypes.bfloat16``), returned as that dtype or up-cast to float32 (JAX's bfloat16 output).
    """

    def __init__(self, declared, how):
        self.dtypes, self.how, self.name = (declared,), how, f"{declared}-{how}"

    def _values(self, compute):
        if self.how == "float64":
            return compute()
        if self.how.startswith("float32"):
            with _in_float32():
                y = compute()
            assert y.dtype == np.float32, y.dtype  # the patched reference did compute in float32
            return y.astype(np.float64) if self.how == "float32-as-float64" else y
        y = _rounded(compute(), self.dtypes[0])
        return y.astype(np.float32) if self.how == "rounded-as-float32" else y

    def forward(self, data, dtype):
        return self._values(lambda: dcf.ReferenceAdapter.forward(self, data, dtype))

    def decode(self, data, dtype):
        return self._values(lambda: dcf.ReferenceAdapter.decode(self, data, dtype))


_PRECISIONS = [
    ("bfloat16", "float64", False),
    ("float16", "float64", False),
    ("float32", "float64", False),
    ("float32", "float32", True),
    ("float32", "float32-as-float64", True),
    ("bfloat16", "rounded", True),
    ("bfloat16", "rounded-as-float32", True),
    ("float16", "rounded", True),
]


@pytest.mark.parametrize(
    "declared, how, passes",
    _PRECISIONS,
    ids=[f"declares-{d}-returns-{h}-{'passes' if ok else 'fails'}" for d, h, ok in _PRECISIONS],
)
def test_outputs_must_be_of_the_declared_precision(declared, how, passes):
    # A port that declared float32 or bfloat16 and computed in float64 passed every check (its
    # values are closer to the reference than the 16-bit tolerance asks), and its report said
    # it conforms in that dtype.
    cases = [dcf.catalogue(["heads-tied-self"])[0], dcf.catalogue(["heads-tied-all-masked-row"])[0]]
    report = dcf.run_conformance(
        _Precision(declared, how),
        cases=cases,
        errors=False,
        decoding=dcf.DECODE_CATALOGUE[:1],
        weights=False,  # the weights' own precision rule: tests/test_conformance_weights_penalty.py
        penalty=False,
    )
    assert [r.check for r in report.results] == ["output", "output", "decode"]
    if passes:
        assert report.passed, report.summary()
        return
    assert all(r.status == "fail" for r in report.results), report.summary()
    for r in report.results:
        what = "forward" if r.check == "output" else "decode"
        assert r.detail.startswith(f"{what} returned float64 values not representable in {declared} ("), r.detail
        assert r.detail.endswith(f"): the port does not compute in {declared}"), r.detail
        assert r.ratio <= 1  # the values are within the tolerance: only the precision check fails them
    # The example element is one the adapter returned, and is not a value of the declared dtype.
    first = report.results[0].detail
    index = tuple(int(i) for i in first.split("element [", 1)[1].split("]", 1)[0].split(", "))
    value = float(first.split("] = ", 1)[1].split(")", 1)[0])
    expected = dcf.materialise(cases[0]).expected
    assert value == expected[index] and float(_rounded(value, declared)) != value


def test_an_output_narrower_than_the_declared_dtype_fails():
    [result] = dcf.check_case(_Precision("float64", "float32"), TINY, "float64", gradients=False)
    assert result.status == "fail", result
    assert result.detail.startswith("forward returned a float32 array, narrower than float64"), result


class _Float64Gradients(_FiniteDifferenceGradients):
    """Outputs rounded to the declared dtype, gradients computed and returned in float64."""

    dtypes = ("bfloat16", "float32")

    def gradients(self, data, dtype):
        return self._float64_gradients(data)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gradients_must_be_of_the_declared_precision(dtype):
    output, grads = dcf.check_case(_Float64Gradients(), TINY, dtype)
    assert output.status == "pass", output
    assert grads.status == "fail" and grads.ratio <= 1, grads
    assert grads.detail.startswith(f"gradients['query'] returned float64 values not representable in {dtype} ("), grads
    n = len(dcf.gradient_targets(dcf.materialise(TINY)))
    assert f"): the port does not compute in {dtype} ({n - 1} more gradients likewise); worst: " in grads.detail, grads
    honest = dcf.check_case(_FiniteDifferenceGradients(), TINY, dtype)
    assert [r.status for r in honest] == ["pass", "pass"], honest


def test_bfloat16_representability_without_ml_dtypes_agrees_with_it():
    """The runner's fallback (the low 16 bits of the float32 pattern are 0) and ml_dtypes' round trip
    agree on which values are bfloat16 values: powers of two, subnormals, float32s, float64s."""
    import ml_dtypes

    from damcha_conformance import _runner

    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.normal(size=200),  # float64: almost never bfloat16
            rng.normal(size=200).astype(np.float32),  # float32: rarely
            rng.normal(size=200).astype(ml_dtypes.bfloat16),  # bfloat16 values: always
            2.0 ** np.arange(-140, 128),  # powers of two; bfloat16's smallest subnormal is 2**-133
            [0.0, -0.0, 1 + 2.0**-7, 1 + 2.0**-8, 3 * 2.0**-133, 3.4e38],
        ]
    ).astype(np.float64)
    with_ml = _runner._round_trip(values, "bfloat16") == values
    with mock.patch.dict(sys.modules, {"ml_dtypes": None}):  # import ml_dtypes raises ImportError
        without = _runner._round_trip(values, "bfloat16") == values
    np.testing.assert_array_equal(with_ml, without)
    assert not with_ml[:200].any() and with_ml[200:400].sum() < 10 and with_ml[400:600].all()
    powers = with_ml[600:868]
    assert not powers[:7].any() and powers[7:].all()  # 2**-140 .. 2**-134 are below bfloat16's range
    np.testing.assert_array_equal(with_ml[868:], [True, True, True, False, True, False])


# ---------------------------------------------------------------- what an adapter is given


class _Spy(_FiniteDifferenceGradients):
    """An honest port that keeps every object it is handed."""

    def __init__(self):
        super().__init__()
        self.name, self.seen = "spy", []

    def forward(self, data, dtype):
        self.seen.append(data)
        return super().forward(data, dtype)

    def gradients(self, data, dtype):
        self.seen.append(data)
        return super().gradients(data, dtype)

    def decode(self, data, dtype):
        self.seen.append(data)
        return super().decode(data, dtype)

    def weights(self, data, dtype):
        self.seen.append(data)
        return super().weights(data, dtype)

    def metric_penalty(self, data, dtype):
        self.seen.append(data)
        return super().metric_penalty(data, dtype)

    def metric_penalty_gradients(self, data, dtype):
        self.seen.append(data)
        return super().metric_penalty_gradients(data, dtype)


def _arrays(obj, path="data", depth=0):
    """Every NumPy array reachable from ``obj`` through its public attributes and mappings."""
    if isinstance(obj, np.ndarray):
        yield path, obj
        return
    if depth > 3 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _arrays(value, f"{path}[{key!r}]", depth + 1)
        return
    for name in dir(obj):
        if not name.startswith("_"):
            value = getattr(obj, name)
            if not callable(value):
                yield from _arrays(value, f"{path}.{name}", depth + 1)


def test_an_adapter_cannot_reach_the_reference_output_through_what_it_is_given():
    # CaseData used to carry `expected` (and `reference()`, which recomputes it): a port could return
    # data.expected and pass every output check.
    decode, error = dcf.DECODE_CATALOGUE[0], dcf.ERROR_CATALOGUE[0]
    spy = _Spy()
    report = dcf.run_conformance(spy, cases=[TINY], errors=[error], decoding=[decode], weights=[TINY], penalty=[TINY])
    kinds = ["output", "gradients", "decode", "weights", "penalty", "penalty-gradients", "rejects"]
    assert report.conformant and [r.check for r in report.results] == kinds, report.summary()
    expected = [dcf.materialise(TINY).expected, dcf.materialise_decode(decode).expected, dcf.reference_weights(TINY)]
    expected.append(dcf.reference_prefill(decode))
    expected.append(dcf.materialise(error.base).expected)
    assert len(spy.seen) == len(kinds)
    for data in spy.seen:
        assert type(data) is dcf.CaseData, type(data)
        assert not hasattr(data, "expected") and not hasattr(data, "reference"), data
        arrays = dict(_arrays(data))
        assert "data.query" in arrays and "data.params['output.bias']" in arrays  # the walk sees the inputs
        for path, array in arrays.items():
            for ref in expected:
                assert not (array.shape == ref.shape and np.allclose(array, ref)), path

    class Copier(dcf.ReferenceAdapter):
        name = "copier"

        def forward(self, data, dtype):
            return data.expected

    [result] = dcf.check_case(Copier(), TINY, "float64", gradients=False)
    assert result.status == "error" and "'CaseData' object has no attribute 'expected'" in result.detail


def test_materialise_keeps_the_expected_output_and_hands_adapters_a_view_without_it():
    full = dcf.materialise(TINY)
    assert isinstance(full, dcf.ReferenceData) and isinstance(full, dcf.CaseData)
    view = full.adapter_data()
    assert {f.name for f in dataclasses.fields(view)} == {f.name for f in dataclasses.fields(full)} - {"expected"}
    assert view.query is full.query and view.config is full.config and view.causal == full.causal
    # an adapter called with the full object (as the ports' own tests do) computes the same output
    np.testing.assert_array_equal(dcf.ReferenceAdapter().forward(full, "float64"), full.expected)


def test_a_long_narrowed_verdict_points_to_the_summary_printed_above_it():
    """The CLI prints the summary, then this line: it pointed a CLI user to a Python
    method ("summary() lists them"); it now says the rest is listed above."""
    report = dcf.Report(results=[dcf.Result("torch", "mha-self", "mha", "float32", "output", "pass")])
    report.subset.extend(("torch", f"narrowing {i}") for i in range(4))
    line = report.verdict_line()
    assert "(and 2 more, listed above in the summary)" in line and "summary()" not in line
