"""The conformance checks of the attention weights (the "weights" group) and of the metric
penalty (the "penalty" group): what they cover, that a port wrong in either alone now fails
(it passed every earlier check), and that a port without them is told so, never passed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _conformance_fixtures import AveragedWeights, PenaltyQueryRoleOnly

import damcha_conformance as dcf
import damcha_core as dc

# Every check but the new ones: what the suite ran before the weights and penalty groups.
EARLIER = dict(weights=False, penalty=False)


def test_the_weights_cases_cover_masks_causal_rules_and_grouped_heads():
    cases = dcf.WEIGHTS_CASES
    assert {c.mask for c in cases} >= {
        None,
        "padding",
        "per_head",
        "all_masked_row",
        "shared",
        "per_head_batch1",
        "per_key",
    }
    lens = [(c.query_len, c.query_len if c.self_attention else c.context_len) for c in cases if c.causal]
    assert any(n == m for n, m in lens) and any(n < m for n, m in lens) and any(n > m for n, m in lens)
    kv = {(c.config.num_kv_heads, c.config.num_heads) for c in cases}
    assert any(g == 1 for g, _ in kv) and any(1 < g < h for g, h in kv) and any(g == h for g, h in kv)
    assert any(not c.self_attention for c in cases) and any(c.batch == 0 or c.query_len == 0 for c in cases)
    # All-masked rows: the reference's weights are 0 in every head of that row (not NaN, not 1/M).
    for case in (c for c in cases if c.mask == "all_masked_row"):
        weights, mask = dcf.reference_weights(case), dcf.materialise(case).mask
        empty = ~np.broadcast_to(mask, weights.shape).any(axis=-1)
        assert empty.any() and np.all(weights[empty] == 0.0), case.name
        assert np.allclose(weights.sum(-1)[~empty], 1.0), case.name


def test_the_penalty_cases_cover_every_metric_and_coupling():
    cases = dcf.PENALTY_CASES
    configs = {(c.config.metric, c.config.coupling) for c in cases if c.config.metric != "none"}
    assert configs == {(m, k) for m in ("heads", "lowrank") for k in ("tied", "separate", "query")}
    assert any(c.config.metric == "none" for c in cases) and dcf.reference_penalty(cases[0]) == 0.0
    assert any(c.batch == 0 for c in cases) and any(c.inputs == "small-and-zero" for c in cases)
    # Cross-attention whose context has the query's shape: the keys' role must read the context.
    assert any(not c.self_attention and c.context_len == c.query_len and c.config.coupling == "tied" for c in cases)
    assert all(c.dtypes is None for c in cases)


class _WrongWeights(dcf.ReferenceAdapter):
    """Outputs right, weights wrong in one way a port gets them wrong."""

    def __init__(self, bug):
        self.bug, self.name = bug, f"weights-{bug}"

    def weights(self, data, dtype):
        probs = super().weights(data, dtype)
        if self.bug == "before-mask":  # the softmax over every key: the mask and the causal rule forgotten
            _, unmasked = dc.damcha_attention(
                data.params, data.config, data.query, data.context, value=data.value, return_weights=True
            )
            return unmasked
        empty = ~probs.any(axis=-1, keepdims=True)
        if self.bug == "uniform-empty-rows":  # a row that sees no key spread evenly, as a plain softmax of -inf + c
            return np.where(empty, 1.0 / max(probs.shape[-1], 1), probs)
        if self.bug == "nan-empty-rows":  # exp(-inf) / 0
            return np.where(empty, np.nan, probs)
        if self.bug == "heads-last":  # (B, N, M, H) relabelled (B, H, N, M): right size, wrong layout
            return np.moveaxis(probs, 1, -1).reshape(probs.shape)
        raise AssertionError(self.bug)


@pytest.mark.parametrize(
    "bug, caught_by",
    [
        ("before-mask", {"heads-tied-padding", "heads-tied-causal", "heads-tied-all-masked-row"}),
        ("uniform-empty-rows", {"heads-tied-all-masked-row", "heads-separate-gqa-all-masked-row-cross"}),
        ("nan-empty-rows", {"heads-tied-all-masked-row", "heads-separate-gqa-all-masked-row-cross"}),
        ("heads-last", {"heads-tied-self", "heads-separate-cross"}),
    ],
    ids=["before-mask", "uniform-empty-rows", "nan-empty-rows", "heads-last"],
)
def test_wrong_weights_fail_the_weights_checks_alone(bug, caught_by):
    # Before the weights group a port could return any weights: this one passes every other check.
    assert dcf.run_conformance(_WrongWeights(bug), **EARLIER).passed
    report = dcf.run_conformance(_WrongWeights(bug), cases=[], errors=False, decoding=False, penalty=False)
    failed = {r.case for r in report.failures()}
    assert caught_by <= failed and all(r.check == "weights" for r in report.failures()), report.summary()
    if bug in ("uniform-empty-rows", "nan-empty-rows"):  # only the cases with rows that see no key
        assert failed == caught_by, failed


def test_head_averaged_weights_fail_and_the_report_says_where():
    # torch's nn.MultiheadAttention averages the heads unless asked not to: the shape is right.
    assert dcf.run_conformance(AveragedWeights(), **EARLIER).passed
    report = dcf.run_conformance(AveragedWeights(), cases=[], errors=False, decoding=False, penalty=False)
    assert not report.passed and "FAIL" in report.table().split("\n")[2]
    failed = {r.case for r in report.failures()}
    # Cases with one key per row, or no row at all, average to the same: every other case fails.
    empty = {c.name for c in dcf.WEIGHTS_CASES if c.batch == 0 or c.query_len == 0}
    assert failed == {c.name for c in dcf.WEIGHTS_CASES} - empty, failed
    worst = report.failures()[0]
    assert worst.group == "weights" and "outside the tolerance, worst at (b, h, n, m) = " in worst.detail, worst


def test_weights_may_be_float32_values_in_16_bit_dtypes_but_not_float64():
    class Declares(dcf.ReferenceAdapter):
        def __init__(self, dtype, returned):
            self.dtypes, self.returned, self.name = (dtype,), returned, f"{dtype}-weights-{returned}"

        def weights(self, data, dtype):
            w = super().weights(data, dtype)
            return w if self.returned == "float64" else w.astype(self.returned)

    case = dcf.WEIGHTS_CASES[1]
    # The spec keeps the softmax in float32 for 16-bit inputs: damcha_jax returns those weights.
    assert dcf.check_weights(Declares("bfloat16", "float32"), case, "bfloat16").status == "pass"
    assert dcf.check_weights(Declares("float16", "float16"), case, "float16").status == "pass"
    for dtype in ("bfloat16", "float32"):
        result = dcf.check_weights(Declares(dtype, "float64"), case, dtype)
        assert result.status == "fail" and "weights returned float64 values not representable in" in result.detail


def test_an_adapter_without_weights_or_penalty_is_partial_never_passed():
    class OutputsOnly:
        name, dtypes, supports_gradients = "outputs-only", ("float64",), False
        unsupported = dcf.ReferenceAdapter.unsupported
        forward = dcf.ReferenceAdapter.forward
        decode = dcf.ReferenceAdapter.decode

    report = dcf.run_conformance(OutputsOnly())
    assert report.passed and report.verdict == "PARTIAL", report.summary()
    skipped = {r.check for r in report.results if r.status == "unsupported"}
    assert skipped == {"weights", "penalty"}
    weights, penalty = len(dcf.WEIGHTS_CASES), len(dcf.PENALTY_CASES)
    assert [g for _, g in report.gaps] == [
        "gradients: the adapter declares none (supports_gradients=False)",
        f"weights: {weights} of {weights} cases unsupported by the adapter (the adapter has no weights(data, dtype))",
        f"penalty: {penalty} of {penalty} cases unsupported by the adapter "
        "(the adapter has no metric_penalty(data, dtype))",
    ], report.gaps
    # Left out on purpose, the run is narrowed, and says so.
    narrowed = dcf.run_conformance(OutputsOnly(), gradients=False, weights=False, penalty=False)
    assert narrowed.verdict == "PASSED", narrowed.summary()
    assert ("outputs-only", "no attention weights") in narrowed.subset
    assert ("outputs-only", "no metric penalty") in narrowed.subset


class _WrongPenalty(dcf.ReferenceAdapter):
    """Outputs and weights right, the metric penalty wrong in one way a port gets it wrong."""

    def __init__(self, bug):
        self.bug, self.name = bug, f"penalty-{bug}"

    def metric_penalty(self, data, dtype):
        config, query, context = data.config, data.query, data.context
        if self.bug == "keys-read-the-query":  # the keys' map fed the query tokens (where they fit)
            if context is not None and context.shape == query.shape:
                context = query
            return dc.metric_penalty(data.params, config, query, context, value=data.value)
        if self.bug == "padded-tokens-left-out":  # the penalty over the tokens the padding mask keeps
            if data.mask is None:
                return super().metric_penalty(data, dtype)
            keep = np.broadcast_to(data.mask[:, 0, 0], (query.shape[0], data.mask.shape[-1]))
            rows = []
            for b in range(query.shape[0]):
                if context is None:
                    rows.append(dc.metric_penalty(data.params, config, query[b : b + 1, keep[b]]))
                else:
                    value = None if data.value is None else data.value[b : b + 1, keep[b]]
                    rows.append(
                        dc.metric_penalty(
                            data.params, config, query[b : b + 1], context[b : b + 1, keep[b]], value=value
                        )
                    )
            return float(np.mean(rows))
        if self.bug == "nan-over-no-token":  # 0 / 0 over an empty batch
            return np.nan if query.size == 0 else super().metric_penalty(data, dtype)
        if self.bug == "not-normalised":  # ||L - I||^2 without the / (S * d)
            S, d = config.num_heads, config.key_dim
            return super().metric_penalty(data, dtype) * S * d
        raise AssertionError(self.bug)


@pytest.mark.parametrize(
    "bug, caught_by",
    [
        ("keys-read-the-query", {"heads-tied-cross-same-shape", "heads-separate-cross-same-shape-small-tokens"}),
        ("padded-tokens-left-out", {"heads-tied-padding", "heads-separate-cross-value-dim"}),
        ("nan-over-no-token", {"heads-tied-self-empty-batch"}),
        ("not-normalised", {"heads-tied-self", "lowrank-query-nobias"}),
    ],
    ids=["keys-read-the-query", "padded-tokens-left-out", "nan-over-no-token", "not-normalised"],
)
def test_a_wrong_penalty_fails_the_penalty_checks_alone(bug, caught_by):
    # Before the penalty group the regulariser was checked nowhere: this port passes everything else.
    assert dcf.run_conformance(_WrongPenalty(bug), **EARLIER).passed
    report = dcf.run_conformance(_WrongPenalty(bug), cases=[], errors=False, decoding=False, weights=False)
    failed = {r.case for r in report.failures()}
    assert caught_by <= failed and all(r.check == "penalty" for r in report.failures()), report.summary()
    if bug in ("keys-read-the-query", "padded-tokens-left-out", "nan-over-no-token"):
        assert failed == caught_by, failed


def test_a_penalty_of_the_query_role_alone_fails_the_cross_attention_cases():
    # Tied self-attention cannot tell (its two roles are one map of the same tokens); cross-attention
    # and separate sides can, the tied cross-attention case included.
    assert dcf.run_conformance(PenaltyQueryRoleOnly(), **EARLIER).passed
    report = dcf.run_conformance(PenaltyQueryRoleOnly(), cases=[], errors=False, decoding=False, weights=False)
    failed = {r.case for r in report.failures()}
    assert "heads-tied-cross-same-shape" in failed and "heads-separate-cross" in failed
    roles_differ = {
        c.name
        for c in dcf.PENALTY_CASES
        if c.config.metric != "none"
        and c.config.coupling != "query"
        and c.batch > 0
        and not (c.self_attention and c.config.coupling == "tied")
    }
    assert failed == roles_differ, failed
    detail = next(r for r in report.failures() if r.case == "heads-separate-cross").detail
    assert detail.startswith("penalty ") and ", expected " in detail, detail


@pytest.mark.parametrize(
    "returned, says",
    [(np.ones(1), "must return a scalar. Received: shape (1,)"), ("0.5", "must be a real floating array")],
    ids=["shape-1", "a-string"],
)
def test_a_penalty_that_is_not_a_scalar_is_an_error(returned, says):
    class Returns(dcf.ReferenceAdapter):
        name = "returns"

        def metric_penalty(self, data, dtype):
            return returned

    result = dcf.check_penalty(Returns(), dcf.PENALTY_CASES[1], "float64")
    assert result.status == "error" and says in result.detail, result


def test_penalty_values_are_not_held_to_the_dtype_but_to_its_tolerance():
    class Float32Penalty(dcf.ReferenceAdapter):
        """A bfloat16 port keeping its loss terms in float32 (as mixed precision does)."""

        name, dtypes = "float32-penalty", ("bfloat16",)

        def metric_penalty(self, data, dtype):
            return np.float32(super().metric_penalty(data, dtype))

    assert dcf.check_penalty(Float32Penalty(), dcf.PENALTY_CASES[1], "bfloat16").status == "pass"
    # ... while a float32 value of a float64 case is outside the float64 tolerance.
    result = dcf.check_penalty(Float32Penalty(), dcf.PENALTY_CASES[1], "float64")
    assert result.status == "fail" and result.ratio > 1, result


def test_an_adapter_with_gradients_but_no_penalty_gradients_has_a_gap_of_its_own():
    class NoPenaltyGradients(dcf.ReferenceAdapter):
        name, supports_gradients = "no-penalty-gradients", True

        def gradients(self, data, dtype):
            raise NotImplementedError

    report = dcf.run_conformance(NoPenaltyGradients(), cases=[], errors=False, decoding=False, weights=False)
    assert [r.status for r in report.results if r.check == "penalty"] == ["pass"] * len(dcf.PENALTY_CASES)
    gaps = [g for _, g in report.gaps]
    assert gaps == [
        f"penalty gradients: {len(dcf.PENALTY_CASES)} of {len(dcf.PENALTY_CASES)} cases unsupported by the adapter "
        "(the adapter has no metric_penalty_gradients(data, dtype))"
    ], gaps


def test_exported_vectors_carry_the_weights_the_penalty_and_a_case_s_dtypes(tmp_path):
    """A foreign port reads the new checks from the files alone; here the naive loop
    implementation's penalty stands in for it."""
    from _naive import naive_metric_penalty
    from safetensors.numpy import load_file

    from damcha_conformance._vectors import export_vectors

    names = ["heads-tied-all-masked-row", "heads-separate-cross", "heads-tied-large-tokens"]
    export_vectors(tmp_path, dcf.catalogue(names))
    index = json.loads((tmp_path / "index.json").read_text())
    assert "7. Attention weights" in index["procedure"] and "8. Metric penalty" in index["procedure"]
    desc = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names}
    tensors = {n: load_file(str(tmp_path / d["tensors"])) for n, d in desc.items()}
    # The weights: (B, H, N, M), rows of 0 where the mask hides every key, rows of 1 elsewhere.
    masked = tensors["heads-tied-all-masked-row"]
    assert desc["heads-tied-all-masked-row"]["weights"] == "expected.weights"
    weights = masked["expected.weights"]
    visible = np.broadcast_to(masked["inputs.mask"], weights.shape)
    assert np.all(weights[~visible] == 0.0) and set(np.round(weights.sum(-1), 12).ravel()) == {0.0, 1.0}
    # The penalty of a cross-attention case: value and directional derivatives, checked by the naive loops.
    cross, penalty = tensors["heads-separate-cross"], desc["heads-separate-cross"]["penalty"]
    config = dc.DamchaConfig.from_dict(desc["heads-separate-cross"]["config"])
    params = {k[len("params.") :]: v for k, v in cross.items() if k.startswith("params.")}
    x, c = cross["inputs.query"], cross["inputs.context"]
    assert naive_metric_penalty(params, config, x, c) == pytest.approx(penalty["value"], rel=1e-10)
    step = 1e-5 * cross["penalty.direction.context"]
    moved = [naive_metric_penalty(params, config, x, c + s * step) for s in (1, -1)]
    assert (moved[0] - moved[1]) / 2e-5 == pytest.approx(penalty["directional_derivatives"]["context"], rel=1e-6)
    assert desc["heads-tied-all-masked-row"]["penalty"] is None and desc["heads-tied-large-tokens"]["weights"] is None
    # Dtypes: null (every dtype) but for the float16-only large-activation case.
    assert [d["dtypes"] for d in desc.values()] == [None, None, ["float16"]]
