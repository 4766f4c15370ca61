"""Run the catalogue through an adapter and compare against the reference."""

from __future__ import annotations

import dataclasses
import json
import re
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from damcha_core import DamchaTypeError, DamchaValueError, describe, invalid_argument
from damcha_core._params import is_real_float

from ._adapter import BackendAdapter
from ._cases import (
    CATALOGUE,
    DECODE_CATALOGUE,
    ERROR_CATALOGUE,
    GROUPS,
    PENALTY_CASES,
    WEIGHTS_CASES,
    Case,
    CaseData,
    DecodeCase,
    ErrorCase,
    ReferenceData,
    gradient_targets,
    materialise,
    materialise_decode,
    materialise_error,
    reference_directional,
    reference_penalty,
    reference_penalty_directional,
    reference_prefill,
    reference_weights,
    resolve_cases,
)
from ._tolerances import DTYPES, tolerance

STATUSES = ("pass", "fail", "error", "unsupported")


@dataclasses.dataclass(frozen=True)
class Result:
    """One check of one case on one backend in one dtype.

    ``check`` is "output", "gradients", "decode" (the outputs of tokens
    decoded after a cached prefix), "weights" (the attention probabilities),
    "penalty" and "penalty-gradients" (the metric penalty and its gradients)
    or "rejects" (bad input must raise);
    ``ratio`` is the worst error over its allowance (pass iff <= 1);
    ``detail`` names the worst tensor or the error raised.
    """

    backend: str
    case: str
    group: str
    dtype: str
    check: str
    status: str
    max_error: float = float("nan")
    ratio: float = float("nan")
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
    """All results of one or more runs.

    ``passed``: at least one check ran and none failed (nor did any backend:
    a note starting with "FAIL"). ``gaps``: (backend, what) that was asked for
    but not checked (a dtype the adapter does not declare, gradients it does
    not support, cases it declares unsupported, decode cases whose prefill it
    did not return, a backend not installed);
    ``subset``: (backend, how) the run was narrowed on purpose. ``verdict``
    is "FAILED", "PARTIAL" (passed, with gaps) or "PASSED".
    """

    results: list[Result] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    gaps: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    subset: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            any(r.status != "unsupported" for r in self.results)
            and all(r.status in ("pass", "unsupported") for r in self.results)
            and not any(n.startswith("FAIL") for n in self.notes)
        )

    @property
    def verdict(self) -> str:
        if not self.passed:
            return "FAILED"
        return "PARTIAL" if self.gaps else "PASSED"

    @property
    def conformant(self) -> bool:
        """Passed, and everything asked for was checked."""
        return self.verdict == "PASSED"

    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status in ("fail", "error")]

    def extend(self, other: Report) -> None:
        self.results.extend(other.results)
        self.notes.extend(other.notes)
        self.gaps.extend(other.gaps)
        self.subset.extend(other.subset)

    def verdict_line(self) -> str:
        """One line: the verdict and, for PARTIAL, what was not checked (for a narrowed PASSED, what
        was left out); readable on its own, without ``summary()`` above it."""
        verdict = self.verdict

        def listed(items: list[tuple[str, str]]) -> str:
            shown = "; ".join(f"{backend}: {text}" for backend, text in items[:2])
            return shown + (f" (and {len(items) - 2} more, listed above in the summary)" if len(items) > 2 else "")

        if verdict == "PARTIAL":
            return f"PARTIAL: not conformant, not everything asked for was checked: {listed(self.gaps)}"
        if verdict == "PASSED" and self.subset:
            return f"PASSED on what was asked for, narrowed: {listed(self.subset)}"
        return verdict

    def summary(self) -> str:
        """The table plus one line per failure, gap and narrowing: what an
        assertion message needs."""
        lines = [self.table()]
        for r in self.failures():
            lines.append(
                f"{r.status.upper()} {r.backend}/{r.dtype} {r.case} [{r.check}] err={r.max_error:.3g} ratio={r.ratio:.3g} {r.detail}"
            )
        lines += [f"not checked: {backend}: {what}" for backend, what in self.gaps]
        lines += [f"subset: {backend}: {how}" for backend, how in self.subset]
        return "\n".join(lines)

    def table(self) -> str:
        """Backend/dtype x case group: passed/total and the worst max error."""
        rows = sorted({(r.backend, r.dtype) for r in self.results}, key=lambda t: (t[0], DTYPES.index(t[1])))
        groups = [g for g in GROUPS if any(r.group == g for r in self.results)]
        header = ["backend", "dtype"] + groups + ["all"]
        body = []
        for backend, dtype in rows:
            row = [backend, dtype]
            mine = [r for r in self.results if r.backend == backend and r.dtype == dtype]
            for group in groups + [None]:
                cell = [r for r in mine if group is None or r.group == group]
                row.append(_cell(cell))
            body.append(row)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
        fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths))  # noqa: E731
        out = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(row) for row in body]
        out += [f"note: {n}" for n in self.notes]
        out.append(
            "cells: checks passed/run (outputs and gradients; 'weights': attention probabilities per head; "
            "'penalty': the metric penalty and its gradients; 'errors': bad inputs rejected with a clear "
            "ValueError), worst max |error|; 'unsup' counts cases the backend declares it cannot run"
        )
        return "\n".join(out)

    def to_json(self) -> str:
        return json.dumps(
            {
                "passed": self.passed,
                "verdict": self.verdict,
                "notes": self.notes,
                "gaps": [list(g) for g in self.gaps],
                "subset": [list(s) for s in self.subset],
                "results": [r.to_dict() for r in self.results],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        return cls(
            [Result(**r) for r in data["results"]],
            list(data.get("notes", [])),
            [tuple(g) for g in data.get("gaps", [])],
            [tuple(s) for s in data.get("subset", [])],
        )


def _cell(results: list[Result]) -> str:
    if not results:
        return "-"
    ran = [r for r in results if r.status != "unsupported"]
    ok = sum(r.status == "pass" for r in ran)
    errs = [r.max_error for r in ran if np.isfinite(r.max_error)]
    text = f"{ok}/{len(ran)}"
    if ok < len(ran):
        text = "FAIL " + text
    if errs:
        text += f" {max(errs):.1e}"
    unsup = len(results) - len(ran)
    if unsup:
        text += f" ({unsup} unsup)"
    return text


def _declined(adapter: BackendAdapter, case: Any, base: dict[str, Any]) -> Result | None:
    """The result of a check the adapter does not run, or None: "unsupported" with the reason
    ``unsupported(case)`` gives, or an error of this check when it raises (a third party's
    ``unsupported`` reading an attribute some cases lack must not end the run, losing every result)."""
    try:
        reason = adapter.unsupported(case)
    except Exception as exc:  # noqa: BLE001 - reported, and the run goes on
        return Result(**base, status="error", detail="unsupported(case) raised " + _describe_exc(exc))
    return Result(**base, status="unsupported", detail=reason) if reason else None


def check_output(adapter: BackendAdapter, case: Case, dtype: str) -> Result:
    """The output check of ``case`` on ``adapter`` in ``dtype``."""
    base: dict[str, Any] = dict(backend=adapter.name, case=case.name, group=case.group, dtype=dtype, check="output")
    declined = _declined(adapter, case, base)
    if declined is not None:
        return declined
    pristine = materialise(case)
    data = _private(pristine)
    result = _output_result(base, lambda: adapter.forward(data, dtype), pristine.expected, dtype, "forward")
    return _untouched(result, data, pristine)


def check_gradients(adapter: BackendAdapter, case: Case, dtype: str) -> Result:
    """The gradient check of ``case``: for each input and parameter, the
    directional derivative of ``sum(output * cotangent)`` against the
    reference's central difference."""
    base: dict[str, Any] = dict(backend=adapter.name, case=case.name, group=case.group, dtype=dtype, check="gradients")
    declined = _declined(adapter, case, base)
    if declined is not None:
        return declined
    if not adapter.supports_gradients:
        return Result(
            **base, status="unsupported", detail="the adapter declares no gradients (supports_gradients=False)"
        )
    pristine = materialise(case)
    data = _private(pristine)
    result = _gradient_result(
        base, lambda: adapter.gradients(data, dtype), data, reference_directional(case), dtype, "gradients"
    )
    return _untouched(result, data, pristine)


def _gradient_result(
    base: dict[str, Any],
    run: Callable[[], Any],
    data: CaseData,
    directional: Mapping[str, tuple[np.ndarray, float]],
    dtype: str,
    method: str,
) -> Result:
    """Judge the gradients ``run()`` returns (the adapter's ``method``: "gradients" or
    "metric_penalty_gradients") against the reference's ``directional`` derivatives, at
    ``dtype``'s gradient tolerance and precision; a crash is a reported error."""
    tol = tolerance(dtype)
    try:
        grads = run()
        if not isinstance(grads, Mapping):
            raise TypeError(
                f"{method}(data, dtype) must return a mapping {{tensor name: gradient array}} "
                f"(see gradient_targets). Received: {describe(grads)}"
            )
        expected_keys = set(gradient_targets(data))
        if set(grads) != expected_keys:
            missing, extra = sorted(expected_keys - set(grads)), sorted(set(grads) - expected_keys)
            raise KeyError(
                f"{method}(data, dtype) must return one gradient per target of gradient_targets(data): "
                + "; ".join(
                    f"{what} {names}" for what, names in (("missing", missing), ("not a target", extra)) if names
                )
            )
        loss = "output" if method == "gradients" else "penalty"
        worst = (0.0, 0.0, "")
        seen: dict[str, tuple[float, float, bool]] = {}  # target -> (dd, dd_ref, all zero), for the detail
        failed = 0
        imprecise: list[str] = []  # why each gradient that is not of the declared precision is not
        for target, (direction, dd_ref) in directional.items():
            g = _real_float64(grads[target], f"the gradient of {target}")
            why = _imprecise(np.asarray(grads[target]), g, dtype, f"{method}[{target!r}]")
            if why:
                imprecise.append(why)
            if g.shape != direction.shape:
                raise ValueError(f"gradient of {target} has shape {g.shape}, expected {direction.shape}")
            dd = float(np.sum(g * direction))
            # max(size, 1): an empty input's gradient is empty (rms 0, not 0/0 = NaN).
            err, ratio = tol.grad_ratio(dd, dd_ref, float(np.linalg.norm(g) / np.sqrt(max(g.size, 1))))
            seen[target] = (dd, dd_ref, not g.any())
            failed += ratio > 1
            if ratio > worst[1]:  # grad_ratio never returns NaN: a NaN gradient is inf
                worst = (err, ratio, target)
        status = "pass" if worst[1] <= 1 and not imprecise else "fail"
        detail = f"worst: {worst[2]}"
        if worst[1] > 1:
            dd, dd_ref, zero = seen[worst[2]]
            detail = (
                f"{failed} of {len(directional)} tensors outside the tolerance, {detail}: "
                f"directional derivative {dd:.6g}, reference {dd_ref:.6g}"
                + (f" (its gradient is all zero: is it detached from the {loss}?)" if zero else "")
            )
        if imprecise:
            more = f" ({len(imprecise) - 1} more gradients likewise)" if len(imprecise) > 1 else ""
            detail = f"{imprecise[0]}{more}; {detail}"
        return Result(**base, status=status, max_error=worst[0], ratio=worst[1], detail=detail)
    except Exception as exc:  # noqa: BLE001 - a port's crash is a reported error, not the end of the run
        return Result(**base, status="error", detail=_describe_exc(exc))


def check_weights(adapter: BackendAdapter, case: Case, dtype: str) -> Result:
    """The attention weights of ``case`` from the adapter's optional ``weights(data, dtype)``:
    the probabilities (B, H, N, M) of every head, after the mask and the causal rule, against the
    reference's at ``dtype``'s output tolerance (a query that sees no key has probabilities 0, not
    NaN or uniform). An adapter without ``weights`` reports the check "unsupported" (a gap, never
    a pass). For 16-bit dtypes the weights may also be float32 values: the spec keeps the softmax
    in at least float32 for 16-bit inputs, and a port may hand back its probabilities as computed
    (damcha_jax does); values finer than float32 still fail, and the forward check holds the
    port's output to the dtype itself."""
    base: dict[str, Any] = dict(backend=adapter.name, case=case.name, group="weights", dtype=dtype, check="weights")
    method = getattr(adapter, "weights", None)
    if method is None:
        return Result(**base, status="unsupported", detail="the adapter has no weights(data, dtype)")
    declined = _declined(adapter, case, base)
    if declined is not None:
        return declined
    pristine = materialise(case)
    data = _private(pristine)
    also = "float32" if dtype in ("float16", "bfloat16") else None
    result = _output_result(base, lambda: method(data, dtype), reference_weights(case), dtype, "weights", also)
    return _untouched(result, data, pristine)


def check_penalty(adapter: BackendAdapter, case: Case, dtype: str) -> Result:
    """The metric penalty of ``case`` from the adapter's optional ``metric_penalty(data, dtype)``
    (a scalar: a float or a 0-d array) against the reference's ``metric_penalty`` at ``dtype``'s
    output tolerance. Its precision is not judged: a penalty is a loss term, which ports keep in
    at least float32 for 16-bit layers (as mixed-precision losses are). An adapter without
    ``metric_penalty`` reports the check "unsupported" (a gap, never a pass)."""
    base: dict[str, Any] = dict(backend=adapter.name, case=case.name, group="penalty", dtype=dtype, check="penalty")
    method = getattr(adapter, "metric_penalty", None)
    if method is None:
        return Result(**base, status="unsupported", detail="the adapter has no metric_penalty(data, dtype)")
    declined = _declined(adapter, case, base)
    if declined is not None:
        return declined
    pristine = materialise(case)
    data = _private(pristine)
    expected = np.float64(reference_penalty(case))
    try:
        value = _real_float64(method(data, dtype), "the metric penalty")
        if value.shape != ():
            raise ValueError(f"metric_penalty(data, dtype) must return a scalar. Received: shape {value.shape}")
    except Exception as exc:  # noqa: BLE001 - a port's crash is a reported error, not the end of the run
        return _untouched(Result(**base, status="error", detail=_describe_exc(exc)), data, pristine)
    tol = tolerance(dtype)
    err, ratio = tol.output_ratio(value, expected)
    # Every digit: a penalty off by float32 rounding reads the same at 6.
    detail = "" if ratio <= 1 else f"penalty {float(value)!r}, expected {float(expected)!r}"
    result = Result(**base, status="pass" if ratio <= 1 else "fail", max_error=err, ratio=ratio, detail=detail)
    return _untouched(result, data, pristine)


def check_penalty_gradients(adapter: BackendAdapter, case: Case, dtype: str) -> Result:
    """The gradients of the metric penalty of ``case`` from the adapter's optional
    ``metric_penalty_gradients(data, dtype)`` (the targets of ``gradients``; 0 for the tensors
    the penalty does not read), judged as ``check_gradients`` judges the output's."""
    base: dict[str, Any] = dict(
        backend=adapter.name, case=case.name, group="penalty", dtype=dtype, check="penalty-gradients"
    )
    declined = _declined(adapter, case, base)
    if declined is not None:
        return declined
    if not adapter.supports_gradients:
        return Result(
            **base, status="unsupported", detail="the adapter declares no gradients (supports_gradients=False)"
        )
    method = getattr(adapter, "metric_penalty_gradients", None)
    if method is None:
        return Result(**base, status="unsupported", detail="the adapter has no metric_penalty_gradients(data, dtype)")
    pristine = materialise(case)
    data = _private(pristine)
    result = _gradient_result(
        base,
        lambda: method(data, dtype),
        data,
        reference_penalty_directional(case),
        dtype,
        "metric_penalty_gradients",
    )
    return _untouched(result, data, pristine)


def check_case(adapter: BackendAdapter, case: Case, dtype: str, gradients: bool = True) -> list[Result]:
    """Run one case on ``adapter`` in ``dtype``: the output check, then the
    gradient check (when asked, supported and the case has one)."""
    results = [check_output(adapter, case, dtype)]
    if results[0].status == "unsupported" or not (gradients and case.gradients and adapter.supports_gradients):
        return results
    results.append(check_gradients(adapter, case, dtype))
    return results


def check_error(adapter: BackendAdapter, case: ErrorCase, dtype: str) -> Result:
    """Feed ``adapter`` the bad input of ``case``: it passes when the port raises
    a ``ValueError`` whose message names the argument (or a port's name for it)
    and what it received. Returning anything, even the right-looking output, fails:
    the input was silently broadcast, sliced or padded."""
    base: dict[str, Any] = dict(backend=adapter.name, case=case.name, group=case.group, dtype=dtype, check="rejects")
    declined = _declined(adapter, case.base, base)
    if declined is not None:
        return declined
    pristine = materialise_error(case)
    data = _private(pristine)
    return _untouched(_rejects(base, case, lambda: adapter.forward(data, dtype)), data, pristine)


def _rejects(base: dict[str, Any], case: ErrorCase, run: Callable[[], Any]) -> Result:
    """The verdict of ``check_error`` on what ``run()`` (the adapter's forward) does."""
    try:
        out = run()
    except ValueError as exc:
        message = str(exc)
        # The argument as a word of its own (`query`, query.shape=, key_padding_mask), and what was
        # received ("Received: ...", Python's "got ..."): a port's own wording passes, a message
        # that names neither does not.
        named = any(re.search(rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])", message) for n in case.names)
        said = re.search(r"\b(received|got)\b", message, re.IGNORECASE) is not None
        status = "pass" if named and said else "fail"
        lacks = [
            what
            for what, ok in (
                (f"name {case.argument!r} (or one of {case.names})", named),
                ("say what it received", said),
            )
            if not ok
        ]
        why = "" if status == "pass" else f"message must {' and '.join(lacks)}: "
        return Result(**base, status=status, detail=f"{why}{type(exc).__name__}: {message.strip()[:300]}")
    except Exception as exc:  # noqa: BLE001 - a crash deep inside a kernel is a failed case, not a clear error
        return Result(
            **base, status="fail", detail="expected a ValueError naming the argument; got " + _describe_exc(exc)
        )
    shape = getattr(out, "shape", None)
    return Result(**base, status="fail", detail=f"bad input accepted ({case.corruption}); returned shape {shape}")


#: The detail of a decode check that passed on the decoded tokens alone: ``run_conformance`` makes
#: each such check a gap (PARTIAL), as it does an unsupported case.
PREFILL_UNCHECKED = "the prefill's outputs were not returned (B, N, E_o), so they went unchecked"


def check_decode(adapter: BackendAdapter, case: DecodeCase, dtype: str) -> Result:
    """Decode ``case`` with the adapter's ``decode`` (prefix into the cache, then
    the new tokens) and compare its outputs with the reference: every token's,
    the prefill's first, when it returns (B, P + N, E_o); the new tokens' alone
    when it returns (B, N, E_o), as adapters written before did (the pass then
    says the prefill went unchecked: a prefill that ignores the causal rule
    passes that way: ``run_conformance`` reports it as a gap, PARTIAL)."""
    base: dict[str, Any] = dict(backend=adapter.name, case=case.name, group=case.group, dtype=dtype, check="decode")
    decode = getattr(adapter, "decode", None)
    if decode is None:
        return Result(**base, status="unsupported", detail="the adapter has no decode(data, dtype)")
    declined = _declined(adapter, case, base)
    if declined is not None:
        return declined
    pristine = materialise_decode(case)
    data = _private(pristine)
    try:
        returned = decode(data, dtype)
    except Exception as exc:  # noqa: BLE001 - a port's crash is a reported error, not the end of the run
        return _untouched(Result(**base, status="error", detail=_describe_exc(exc)), data, pristine)
    # The two forms differ in length whenever there is a prefix (P >= 1 in every decode case).
    shape: tuple[int, ...] = tuple(getattr(returned, "shape", ()))
    whole = len(shape) == 3 and shape[1] == case.prefix_len + case.new_len and case.prefix_len > 0
    expected = np.concatenate([reference_prefill(case), pristine.expected], axis=1) if whole else pristine.expected
    result = _output_result(base, lambda: returned, expected, dtype, "decode")
    if not whole and result.status == "pass":
        result = dataclasses.replace(result, detail=PREFILL_UNCHECKED)
    return _untouched(result, data, pristine)


_ARRAYS = ("query", "context", "value", "mask", "cotangent")


def _private(data: ReferenceData) -> CaseData:
    """What one call of the adapter is given: a plain ``CaseData`` (no ``expected``, no
    ``reference()``: a port must not be able to hand the reference's answer back) with arrays of
    its own.

    ``materialise`` is cached: an adapter given its arrays and writing into them (an in-place op
    on ``torch.from_numpy(data.query)``, which shares the memory) would change what every later
    check in the process compares against, other dtypes' and other adapters' included."""
    arrays: dict[str, Any] = {n: None if getattr(data, n) is None else np.array(getattr(data, n)) for n in _ARRAYS}
    view = data.adapter_data()
    return dataclasses.replace(view, params={k: np.array(v) for k, v in data.params.items()}, **arrays)


def _untouched(result: Result, given: CaseData, pristine: CaseData) -> Result:
    """``result``, failed if the adapter wrote into the arrays it was given (``_private``): a port
    must leave its inputs as they were, as the reference does."""
    written = [f"data.{n}" for n in _ARRAYS if not _same(getattr(given, n), getattr(pristine, n))]
    if given.params.keys() != pristine.params.keys():
        written.append("data.params (its keys)")
    else:
        written += [f"data.params[{k!r}]" for k, v in pristine.params.items() if not _same(given.params[k], v)]
    if not written:
        return result
    named = ", ".join(written[:3]) + (f" and {len(written) - 3} more" if len(written) > 3 else "")
    why = (
        f"the adapter wrote into {named} in place (a port must leave its inputs unchanged; "
        "torch.from_numpy shares the array's memory)"
    )
    return dataclasses.replace(
        result,
        status="fail" if result.status == "pass" else result.status,
        detail=why + (f"; {result.detail}" if result.detail else ""),
    )


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))


def _output_result(
    base: dict[str, Any], run: Any, expected: np.ndarray, dtype: str, what: str, also: str | None = None
) -> Result:
    """Run ``run()`` (the adapter's ``what``: "forward", "decode" or "weights") and judge its output
    against ``expected`` at ``dtype``'s tolerance, and its precision (``_imprecise``): ``dtype``
    values, or ``also`` values where given; a crash is a reported error, not the end of the run."""
    tol = tolerance(dtype)
    try:
        returned = run()
        out = _real_float64(returned, "the output")
    except Exception as exc:  # noqa: BLE001 - a port's crash is a reported error, not the end of the run
        return Result(**base, status="error", detail=_describe_exc(exc))
    err, ratio = tol.output_ratio(out, expected)
    if out.shape != expected.shape:
        detail = f"shape {out.shape} != expected {expected.shape}"
    else:
        detail = _where(out, expected, tol) if ratio > 1 else ""
    imprecise = _imprecise(np.asarray(returned), out, dtype, what)
    if imprecise and also is not None and not _imprecise(np.asarray(returned), out, also, what):
        imprecise = ""
    if imprecise:
        detail = imprecise + (f"; {detail}" if detail else "")
    status = "pass" if ratio <= 1 and not imprecise else "fail"
    return Result(**base, status=status, max_error=err, ratio=ratio, detail=detail)


# (significand bits, exponent bits) of the dtypes a port may declare: a returned array of another
# real float dtype holds every value of the declared one only if it has at least as many of both.
_BITS = {"float16": (11, 5), "bfloat16": (8, 8), "float32": (24, 8), "float64": (53, 11)}


def _bits(dtype: np.dtype) -> tuple[int, int]:
    if dtype.name in _BITS:
        return _BITS[dtype.name]
    info = np.finfo(dtype)  # any other real float is a NumPy one (is_real_float): long double
    return info.nmant + 1, info.nexp


def _imprecise(returned: np.ndarray, values: np.ndarray, dtype: str, what: str) -> str:
    """Why an array the adapter returned is not of the declared precision ``dtype``, or "".

    The runner only sees NumPy arrays, so "computes in ``dtype``" is checked on what comes back:
    an array of ``dtype`` itself; or an up-cast (a wider float: NumPy has no bfloat16, and the
    built-in adapters hand back float64 copies) whose every finite value is exactly a ``dtype``
    value. A port that declares bfloat16 and computes in float64 returns values that almost never
    round-trip through bfloat16 (a random float64 value fits float32 with odds of 2**-29): without
    this it passed, and its report said it conforms in bfloat16. An array narrower than ``dtype``
    (float32 for float64) cannot hold its values at all. ``values`` is ``returned`` in float64.
    What this cannot see: a port computing in float64 that rounds only its final result to
    ``dtype``."""
    got = returned.dtype
    if got.name == dtype:
        return ""
    if any(g < d for g, d in zip(_bits(got), _BITS[dtype])):
        return (
            f"{what} returned a {got.name} array, narrower than {dtype}: the port does not compute in {dtype} "
            f"(return {dtype} values, or a wider float array holding them)"
        )
    finite = np.isfinite(values)
    with np.errstate(over="ignore", invalid="ignore"):
        off = finite & (_round_trip(values, dtype) != values)
    if not off.any():
        return ""
    first = tuple(int(i) for i in np.argwhere(off)[0])
    where = f"element [{', '.join(map(str, first))}]" if first else "its value"
    return (
        f"{what} returned {got.name} values not representable in {dtype} ({int(off.sum())} of {off.size}, "
        f"e.g. {where} = {float(values[first])!r}): the port does not compute in {dtype}"
    )


def _round_trip(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` (float64) rounded to ``dtype`` and back: equal exactly where representable."""
    if dtype != "bfloat16":
        return values.astype(dtype).astype(np.float64)
    try:
        import ml_dtypes  # installed with JAX
    except ImportError:
        # bfloat16 is the upper half of a float32: a value is one iff it is a float32 whose low
        # 16 bits are 0 (truncating them changes any other value, and any non-float32 value).
        bits = values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        return bits.view(np.float32).astype(np.float64)
    return values.astype(ml_dtypes.bfloat16).astype(np.float64)


def _where(out: np.ndarray, expected: np.ndarray, tol: Any) -> str:
    """Where a failed output is wrong, for a port's author: the non-finite values and the query
    rows holding them (a row that sees no key must give 0, not NaN), else how many elements are
    outside the tolerance and the worst one, with its value and the expected one."""
    axes = {3: "(b, n, e)", 4: "(b, h, n, m)"}.get(out.ndim, "index")

    def at(where: np.ndarray) -> tuple[int, int, tuple[int, ...]]:
        found = np.argwhere(where)
        rows = len({tuple(i[:-1]) for i in found}) if out.ndim > 1 else 1
        return int(where.sum()), rows, tuple(int(i) for i in found[0])

    reference_bad = ~np.isfinite(expected)
    bad = ~np.isfinite(out) & ~reference_bad
    if bad.any():
        count, rows, first = at(bad)
        return (
            f"{count} non-finite values (NaN or inf) where the reference is finite, in {rows} query rows, "
            f"first at {axes} = {first}"
        )
    quiet = np.isfinite(out) & reference_bad
    if quiet.any():
        # A port that zeroes (or otherwise fills) a NaN row: "0 elements outside the tolerance" said nothing.
        count, rows, first = at(quiet)
        return (
            f"{count} finite values where the reference is NaN or inf (NaN in must give NaN out), in {rows} "
            f"query rows, first at {axes} = {first}: {out[first]:.6g}, expected {expected[first]:.6g}"
        )
    both = np.isfinite(expected)
    out, expected = np.where(both, out, 0.0), np.where(both, expected, 0.0)
    excess = np.abs(out - expected) / (tol.atol + tol.rtol * np.abs(expected))
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(excess), excess.shape))
    return (
        f"{int((excess > 1).sum())} of {out.size} elements outside the tolerance, worst at {axes} = {worst}: "
        f"{out[worst]:.6g}, expected {expected[worst]:.6g}"
    )


def _real_float64(value: Any, what: str) -> np.ndarray:
    """``value`` in float64, refusing anything that is not a real floating array:
    np.asarray(..., float64) would drop a complex output's imaginary part (an
    output of ref + 1e6j scored error 0) and accept integers or booleans."""
    array = np.asarray(value)
    if not is_real_float(array.dtype):
        raise TypeError(
            f"{what} must be a real floating array (float16/bfloat16/float32/float64). "
            f"Received: dtype {array.dtype}, shape {array.shape}"
        )
    return array.astype(np.float64)


def _describe_exc(exc: Exception) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


#: The kinds of check, as the pytest plugin names them (``Result.check`` says
#: "output" for forward and "rejects" for errors).
CHECKS = ("forward", "gradients", "decode", "weights", "penalty", "penalty-gradients", "errors")

# The kinds whose results form a group of their own (a column of the table), whatever the case's group.
_OWN_GROUP = {"decode": "decode", "weights": "weights", "penalty": "penalty", "penalty-gradients": "penalty"}


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of a conformance run: a kind (one of ``CHECKS``), a case and a
    dtype. ``id`` is the readable, stable test id (``forward-float32-heads-tied-self``,
    ``errors-float32-context-empty:heads-separate-cross``)."""

    kind: str
    case: Any
    dtype: str

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.dtype}-{self.case.name}"

    @property
    def group(self) -> str:
        """The group its result counts towards: "weights" and "penalty" for those checks, else the case's."""
        return _OWN_GROUP.get(self.kind, self.case.group)

    def run(self, adapter: BackendAdapter) -> Result:
        runners: dict[str, Callable[[BackendAdapter, Any, str], Result]] = {
            "forward": check_output,
            "gradients": check_gradients,
            "decode": check_decode,
            "weights": check_weights,
            "penalty": check_penalty,
            "penalty-gradients": check_penalty_gradients,
        }
        return runners.get(self.kind, check_error)(adapter, self.case, self.dtype)


@dataclasses.dataclass
class Plan:
    """The checks of a run, in order (each case's forward check just before its
    gradient check, which lets adapters reuse one computation), what was asked
    for but cannot be checked (``gaps``) and how the run is narrowed
    (``subset``), both as (backend, text)."""

    checks: list[Check]
    gaps: list[tuple[str, str]]
    subset: list[tuple[str, str]]


def check_adapter(adapter: Any) -> None:
    """Refuse an object that is not a usable adapter, naming what it lacks.

    Raises:
        DamchaTypeError: a missing attribute or method (instead of an
            AttributeError deep in a check; ``gradients`` too when
            ``supports_gradients``), or ``dtypes`` given as one string
            (iterating "float64" yields letters).
        DamchaValueError: ``dtypes`` empty or naming a dtype that is not a
            key of ``TOLERANCES`` (e.g. "fp32").
    """
    for attr in ("name", "dtypes", "supports_gradients", "unsupported", "forward"):
        if not hasattr(adapter, attr):
            raise DamchaTypeError(
                f"adapter lacks {attr}: a conformance adapter has name, dtypes, supports_gradients, "
                f"unsupported(case) and forward(data, dtype) (see damcha_conformance.BackendAdapter). "
                f"Received: {type(adapter).__module__}.{type(adapter).__qualname__}"
            )
    if not isinstance(adapter.name, str) or not adapter.name.strip():
        # Results are keyed by it (the table's rows, the JSON); None or "" breaks both.
        raise DamchaTypeError(
            invalid_argument("adapter.name", "a non-empty string, e.g. 'my-port'", f"adapter.name={adapter.name!r}")
        )
    for method in ("unsupported", "forward"):
        if not callable(getattr(adapter, method)):
            raise DamchaTypeError(
                invalid_argument(
                    f"adapter.{method}", "a method", f"adapter.{method}={describe(getattr(adapter, method))}"
                )
            )
    names = check_dtype_names(adapter.dtypes, "adapter.dtypes")
    if len(set(names)) != len(names):
        # Each would run every check again, counted twice in the table.
        raise DamchaValueError(
            invalid_argument("adapter.dtypes", "each dtype name once", f"adapter.dtypes={tuple(names)!r}")
        )
    if not names or any(d not in DTYPES for d in names):
        # Found here, so that the CLI and the pytest plugin refuse it as a usage error, not a worker's traceback.
        raise DamchaValueError(
            invalid_argument(
                "adapter.dtypes",
                f"a non-empty sequence of dtype names, some of {DTYPES} (the keys of TOLERANCES)",
                f"adapter.dtypes={tuple(names)!r}",
            )
        )
    if not isinstance(adapter.supports_gradients, (bool, np.bool_)):
        # A string such as "no" is truthy: the gradient checks would run (and error).
        raise DamchaTypeError(
            invalid_argument(
                "adapter.supports_gradients", "a bool", f"adapter.supports_gradients={adapter.supports_gradients!r}"
            )
        )
    if adapter.supports_gradients and not callable(getattr(adapter, "gradients", None)):
        raise DamchaTypeError(
            invalid_argument(
                "adapter.gradients",
                "a method gradients(data, dtype) when supports_gradients is True (or supports_gradients = False)",
                f"adapter.gradients={describe(getattr(adapter, 'gradients', None))}"
                + ("" if hasattr(adapter, "gradients") else " (no such attribute)"),
            )
        )


def check_dtype_names(dtypes: Any, argument: str = "dtypes") -> list[str]:
    """``dtypes`` as a list of names; one string (iterated, its letters) is refused with the hint."""
    if isinstance(dtypes, (str, bytes)) or not isinstance(dtypes, Iterable):
        raise DamchaTypeError(
            invalid_argument(
                argument,
                f"a sequence of dtype names, e.g. ('float64',), some of {DTYPES}",
                f"{argument}={dtypes!r}" + (" (one string, read letter by letter)" if isinstance(dtypes, str) else ""),
            )
        )
    return list(dtypes)


def plan_checks(
    adapter: BackendAdapter,
    cases: Iterable[Case] | None = None,
    dtypes: Sequence[str] | None = None,
    gradients: bool = True,
    errors: bool | Iterable[ErrorCase] = True,
    decoding: bool | Iterable[DecodeCase] = True,
    weights: bool | Iterable[Case] = True,
    penalty: bool | Iterable[Case] = True,
) -> Plan:
    """The checks ``run_conformance`` runs with these arguments (see there).

    A dtype the adapter does not declare in ``adapter.dtypes`` is not run: it
    is one gap, never a row of numbers computed in another dtype. A case with
    ``dtypes`` of its own runs only in those (the float16 large-activation cases).

    Raises:
        DamchaValueError: an unknown dtype name.
    """
    check_adapter(adapter)
    name = adapter.name
    cases = list(CATALOGUE) if cases is None else resolve_cases(cases, CATALOGUE, "cases")
    declared = list(adapter.dtypes)
    asked = list(declared if dtypes is None else dict.fromkeys(check_dtype_names(dtypes)))
    for dtype in asked:
        tolerance(dtype)  # unknown dtype names fail before any work

    def selected(flag: Any, every: tuple[Any, ...], known: tuple[Any, ...], argument: str) -> list[Any]:
        # True: every case of its kind; False/None: none; else cases or their names.
        if flag is True:
            return list(every)
        return [] if flag is False or flag is None else resolve_cases(flag, known, argument)

    error_cases = selected(errors, ERROR_CATALOGUE, ERROR_CATALOGUE, "errors")
    decode_cases = selected(decoding, DECODE_CATALOGUE, DECODE_CATALOGUE, "decoding")
    weight_cases = selected(weights, WEIGHTS_CASES, CATALOGUE, "weights")
    penalty_cases = selected(penalty, PENALTY_CASES, CATALOGUE, "penalty")
    gaps: list[tuple[str, str]] = []
    subset: list[tuple[str, str]] = []
    run = [d for d in asked if d in declared]
    undeclared = [d for d in asked if d not in declared]
    if undeclared:
        gaps.append(
            (name, f"dtype {', '.join(undeclared)}: not among the adapter's dtypes ({', '.join(declared) or 'none'})")
        )
    if set(run) != set(declared) and not undeclared:
        subset.append((name, f"dtypes {', '.join(run)} of {', '.join(declared)}"))
    if len(cases) != len(CATALOGUE) or set(cases) != set(CATALOGUE):
        subset.append((name, f"{len(cases)} of {len(CATALOGUE)} catalogue cases"))
    grads = gradients and adapter.supports_gradients
    if not gradients:
        subset.append((name, "no gradients"))
    elif not adapter.supports_gradients and any(c.gradients for c in cases):
        gaps.append((name, "gradients: the adapter declares none (supports_gradients=False)"))
    if len(decode_cases) != len(DECODE_CATALOGUE):
        subset.append((name, f"{len(decode_cases)} of {len(DECODE_CATALOGUE)} decode cases"))
    for flag, chosen, every, what in (
        (weights, weight_cases, WEIGHTS_CASES, "attention weights"),
        (penalty, penalty_cases, PENALTY_CASES, "metric penalty"),
    ):
        if flag is False:
            subset.append((name, f"no {what}"))  # the CLI adds a built-in backend's reason (Builtin.limits)
        elif len(chosen) != len(every):
            subset.append((name, f"{len(chosen)} of {len(every)} {what} cases"))
    if len(error_cases) != len(ERROR_CATALOGUE):
        subset.append((name, f"{len(error_cases)} of {len(ERROR_CATALOGUE)} bad-input cases"))
    checks: list[Check] = []
    for dtype in run:
        for case in cases:
            if not case.runs_in(dtype):
                continue
            checks.append(Check("forward", case, dtype))
            if grads and case.gradients:
                checks.append(Check("gradients", case, dtype))
        checks += [Check("decode", case, dtype) for case in decode_cases]
        checks += [Check("weights", case, dtype) for case in weight_cases if case.runs_in(dtype)]
        for case in penalty_cases:
            if case.runs_in(dtype):
                checks.append(Check("penalty", case, dtype))
                if grads and case.gradients:
                    checks.append(Check("penalty-gradients", case, dtype))
    # Last, after every dtype's other checks: run_conformance leaves out the bad input of a dtype the
    # adapter refused outright. Every dtype, not the first alone: a port's float32 path that skipped
    # the mask's validation passed when they ran in float64 only (they cost well under a second).
    for dtype in run:
        checks += [Check("errors", case, dtype) for case in error_cases]
    return Plan(checks, gaps, subset)


def _unsupported_gaps(name: str, results: list[Result]) -> list[tuple[str, str]]:
    """One gap per group with cases the adapter declared unsupported (said "<group> gradients"
    when only gradient checks were: the penalty's values ran, its gradients did not)."""
    gaps = []
    for group in GROUPS:
        mine = [r for r in results if r.group == group]
        skipped = [r for r in mine if r.status == "unsupported"]
        if skipped:
            cases = sorted({r.case for r in skipped})
            total = len({r.case for r in mine})
            what = f"{group} gradients" if all(r.check.endswith("gradients") for r in skipped) else group
            gaps.append(
                (name, f"{what}: {len(cases)} of {total} cases unsupported by the adapter ({skipped[0].detail})")
            )
    return gaps


def prefill_gaps(name: str, results: Iterable[Result]) -> list[tuple[str, str]]:
    """One gap when decode checks passed on the decoded tokens' outputs alone (``PREFILL_UNCHECKED``):
    half of what the check asks for went unchecked (a prefill that lets the prompt see its future
    passes that way), so the verdict must not be a plain PASSED. The detail of a passing result
    was the only place that said so."""
    unchecked = [r for r in results if r.check == "decode" and r.status == "pass" and r.detail == PREFILL_UNCHECKED]
    if not unchecked:
        return []
    cases = sorted({r.case for r in unchecked})
    dtypes = ", ".join(dict.fromkeys(r.dtype for r in unchecked))
    return [
        (
            name,
            f"decode prefill: {len(cases)} decode cases ({dtypes}) returned the decoded tokens' outputs alone "
            "(B, N, E_o), so the prefill's went unchecked; return every token's (B, P + N, E_o), the prefill's first",
        )
    ]


def run_conformance(
    adapter: BackendAdapter,
    cases: Iterable[Case] | None = None,
    dtypes: Sequence[str] | None = None,
    gradients: bool = True,
    errors: bool | Iterable[ErrorCase] = True,
    decoding: bool | Iterable[DecodeCase] = True,
    progress: Callable[[Result, int, int], None] | None = None,
    weights: bool | Iterable[Case] = True,
    penalty: bool | Iterable[Case] = True,
) -> Report:
    """Run ``cases`` (default: the whole catalogue) on ``adapter`` in each of
    ``dtypes`` (default: ``adapter.dtypes``) and return the report.

    ``decoding``: also run ``DECODE_CATALOGUE`` (or the given decode cases)
    through the adapter's optional ``decode`` method, in every dtype; an
    adapter without one reports them "unsupported".

    ``weights``: also compare the attention probabilities of ``WEIGHTS_CASES``
    (or the given catalogue cases) through the adapter's optional ``weights``
    method; ``penalty``: the metric penalty of ``PENALTY_CASES`` (or the given
    cases) through its optional ``metric_penalty``, and with gradients its
    ``metric_penalty_gradients``. Like ``decode``, a missing method reports
    its checks "unsupported" (a gap); ``False`` leaves them out on purpose (a
    subset).

    ``errors``: also feed the bad inputs of ``ERROR_CATALOGUE`` (or the given
    error cases) and require a clear ``ValueError`` for each, in every dtype
    (a port's paths per dtype may validate differently); not in a dtype
    whose every other check ended in an error or is one the adapter does not
    support (the adapter refuses that
    dtype outright, which says nothing about bad input: a gap).

    ``progress``: called after each check with (result, checks done, checks planned).

    The report says what was not checked: a dtype the adapter does not
    declare (not run, stated once), gradients of an adapter without them,
    unsupported cases (``Report.gaps``, verdict "PARTIAL"); a run that checked
    nothing does not pass.
    """
    plan = plan_checks(adapter, cases, dtypes, gradients, errors, decoding, weights, penalty)
    report = Report(gaps=list(plan.gaps), subset=list(plan.subset))
    other_dtypes = {c.dtype for c in plan.checks if c.kind != "errors"}
    total = len(plan.checks)
    done = 0
    refused: list[str] = []  # dtypes whose bad-input checks were left out
    for check in plan.checks:
        # A dtype the adapter refuses outright (every other check an error, or a check it does not
        # support: weights, penalty, decode of a forward-only port) says nothing about bad
        # input: each of its error cases would fail for that refusal alone.
        if (
            check.kind == "errors"
            and check.dtype in other_dtypes
            and check.dtype not in refused
            and not any(r.dtype == check.dtype and r.status not in ("error", "unsupported") for r in report.results)
        ):
            refused.append(check.dtype)
        if check.kind == "errors" and check.dtype in refused:
            total -= 1
            continue
        result = check.run(adapter)
        report.results.append(result)
        done += 1
        if progress is not None:
            progress(result, done, total)
    if refused:
        report.gaps.append(
            (
                adapter.name,
                f"errors in {', '.join(refused)}: the bad-input checks did not run, every other check in "
                f"{'that dtype' if len(refused) == 1 else 'those dtypes'} ended in an error or is unsupported",
            )
        )
    report.gaps += _unsupported_gaps(adapter.name, report.results) + prefill_gaps(adapter.name, report.results)
    if not any(r.status != "unsupported" for r in report.results):
        why = "see 'not checked'" if report.gaps else "no check was asked for"
        report.notes.append(f"FAIL {adapter.name}: nothing checked ({why})")
    return report
