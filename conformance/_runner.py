"""Run the catalogue through an adapter and compare against the reference."""

from __future__ import annotations

import dataclasses
import json
import traceback
from typing import Any, Iterable, Sequence

import numpy as np

from ._adapter import BackendAdapter
from ._cases import (
    CATALOGUE,
    DECODE_CATALOGUE,
    ERROR_CATALOGUE,
    GROUPS,
    Case,
    DecodeCase,
    ErrorCase,
    gradient_targets,
    materialise,
    materialise_decode,
    materialise_error,
    reference_directional,
)
from ._tolerances import DTYPES, tolerance

STATUSES = ("pass", "fail", "error", "unsupported")


@dataclasses.dataclass(frozen=True)
class Result:
    """One check of one case on one backend in one dtype.

    ``check`` is "output", "gradients", "decode" (the outputs of tokens
    decoded after a cached prefix) or "rejects" (bad input must raise);
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
    """All results of one or more runs; ``passed`` is False on any fail/error."""

    results: list[Result] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.status in ("pass", "unsupported") for r in self.results) and not any(
            n.startswith("FAIL") for n in self.notes
        )

    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status in ("fail", "error")]

    def extend(self, other: "Report") -> None:
        self.results.extend(other.results)
        self.notes.extend(other.notes)

    def summary(self) -> str:
        """The table plus one line per failure: what an assertion message needs."""
        lines = [self.table()]
        for r in self.failures():
            lines.append(f"{r.status.upper()} {r.backend}/{r.dtype} {r.case} [{r.check}] err={r.max_error:.3g} ratio={r.ratio:.3g} {r.detail}")
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
        out.append("cells: checks passed/run (outputs and gradients; 'errors': bad inputs rejected with a clear "
                   "ValueError), worst max |error|; 'unsup' counts cases the backend declares it cannot run")
        return "\n".join(out)

    def to_json(self) -> str:
        return json.dumps({"passed": self.passed, "notes": self.notes, "results": [r.to_dict() for r in self.results]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Report":
        data = json.loads(text)
        return cls([Result(**r) for r in data["results"]], list(data.get("notes", [])))


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


def check_case(adapter: BackendAdapter, case: Case, dtype: str, gradients: bool = True) -> list[Result]:
    """Run one case on ``adapter`` in ``dtype``: the output check, then the
    gradient check (when asked, supported and the case has one)."""
    tol = tolerance(dtype)
    base = dict(backend=adapter.name, case=case.name, group=case.group, dtype=dtype)
    reason = adapter.unsupported(case)
    if reason:
        return [Result(**base, check="output", status="unsupported", detail=reason)]
    data = materialise(case)
    results = [_output_result(dict(base, check="output"), lambda: adapter.forward(data, dtype), data.expected, tol)]
    if not (gradients and case.gradients and adapter.supports_gradients):
        return results
    try:
        grads = adapter.gradients(data, dtype)
        expected_keys = set(gradient_targets(data))
        if set(grads) != expected_keys:
            raise KeyError(f"gradients keys {sorted(grads)} != expected {sorted(expected_keys)}")
        worst = (0.0, 0.0, "")
        for target, (direction, dd_ref) in reference_directional(case).items():
            g = np.asarray(grads[target], dtype=np.float64)
            if g.shape != direction.shape:
                raise ValueError(f"gradient of {target} has shape {g.shape}, expected {direction.shape}")
            err, ratio = tol.grad_ratio(float(np.sum(g * direction)), dd_ref, float(np.linalg.norm(g) / np.sqrt(g.size)))
            if ratio > worst[1]:  # grad_ratio never returns NaN: a NaN gradient is inf
                worst = (err, ratio, target)
        status = "pass" if worst[1] <= 1 else "fail"
        results.append(Result(**base, check="gradients", status=status, max_error=worst[0], ratio=worst[1], detail=f"worst: {worst[2]}"))
    except Exception as exc:
        results.append(Result(**base, check="gradients", status="error", detail=_describe_exc(exc)))
    return results


def check_error(adapter: BackendAdapter, case: ErrorCase, dtype: str) -> Result:
    """Feed ``adapter`` the bad input of ``case``: it passes when the port raises
    a ``ValueError`` whose message names the argument (or a port's name for it)
    and what it received. Returning anything, even the right-looking output, fails:
    the input was silently broadcast, sliced or padded."""
    base = dict(backend=adapter.name, case=case.name, group=case.group, dtype=dtype, check="rejects")
    reason = adapter.unsupported(case.base)
    if reason:
        return Result(**base, status="unsupported", detail=reason)
    data = materialise_error(case)
    try:
        out = adapter.forward(data, dtype)
    except ValueError as exc:
        message = str(exc)
        named = any(f"`{n}" in message or f"{n}.shape" in message or f"{n}=" in message or f"_{n}" in message
                    for n in case.names)
        said = "Received" in message or "received" in message
        status = "pass" if named and said else "fail"
        why = "" if status == "pass" else (
            f"message must name {case.argument!r} (or one of {case.names}) and say what it received: "
        )
        return Result(**base, status=status, detail=f"{why}{type(exc).__name__}: {message.strip()[:300]}")
    except Exception as exc:  # a crash deep inside a kernel is not a clear error
        return Result(**base, status="fail", detail="expected a ValueError naming the argument; got " + _describe_exc(exc))
    shape = getattr(out, "shape", None)
    return Result(**base, status="fail", detail=f"bad input accepted ({case.corruption}); returned shape {shape}")


def check_decode(adapter: BackendAdapter, case: DecodeCase, dtype: str) -> Result:
    """Decode ``case`` with the adapter's ``decode`` (prefix into the cache, then
    the new tokens) and compare the new tokens' outputs with the reference."""
    base = dict(backend=adapter.name, case=case.name, group=case.group, dtype=dtype, check="decode")
    decode = getattr(adapter, "decode", None)
    if decode is None:
        return Result(**base, status="unsupported", detail="the adapter has no decode(data, dtype)")
    reason = adapter.unsupported(case)  # type: ignore[arg-type]
    if reason:
        return Result(**base, status="unsupported", detail=reason)
    data = materialise_decode(case)
    return _output_result(base, lambda: decode(data, dtype), data.expected, tolerance(dtype))


def _output_result(base: dict[str, Any], run: Any, expected: np.ndarray, tol: Any) -> Result:
    """Run ``run()`` and judge its output against ``expected``; a crash is a
    reported error, not the end of the run."""
    try:
        out = np.asarray(run(), dtype=np.float64)
    except Exception as exc:
        return Result(**base, status="error", detail=_describe_exc(exc))
    err, ratio = tol.output_ratio(out, expected)
    detail = "" if out.shape == expected.shape else f"shape {out.shape} != expected {expected.shape}"
    return Result(**base, status="pass" if ratio <= 1 else "fail", max_error=err, ratio=ratio, detail=detail)


def _describe_exc(exc: Exception) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_conformance(
    adapter: BackendAdapter,
    cases: Iterable[Case] | None = None,
    dtypes: Sequence[str] | None = None,
    gradients: bool = True,
    errors: bool | Iterable[ErrorCase] = True,
    decoding: bool | Iterable[DecodeCase] = True,
) -> Report:
    """Run ``cases`` (default: the whole catalogue) on ``adapter`` in each of
    ``dtypes`` (default: ``adapter.dtypes``) and return the report.

    ``decoding``: also run ``DECODE_CATALOGUE`` (or the given decode cases)
    through the adapter's optional ``decode`` method, in every dtype; an
    adapter without one reports them "unsupported".

    ``errors``: also feed the bad inputs of ``ERROR_CATALOGUE`` (or the given
    error cases) and require a clear ``ValueError`` for each; they run once,
    in the first dtype the adapter ran any case in (the rules are about
    shapes, not precision).
    """
    cases = list(CATALOGUE if cases is None else cases)
    dtypes = list(adapter.dtypes if dtypes is None else dtypes)
    error_cases = list(ERROR_CATALOGUE if errors is True else (errors or ()))
    decode_cases = list(DECODE_CATALOGUE if decoding is True else (decoding or ()))
    for dtype in dtypes:
        tolerance(dtype)  # unknown dtype names fail before any work
    report = Report()
    for dtype in dtypes:
        for case in cases:
            report.results.extend(check_case(adapter, case, dtype, gradients))
        report.results.extend(check_decode(adapter, case, dtype) for case in decode_cases)
    # A dtype the adapter refuses outright (every case an error) says nothing about bad input.
    usable = [d for d in dtypes if not cases or any(r.dtype == d and r.status != "error" for r in report.results)]
    if usable:
        report.results.extend(check_error(adapter, case, usable[0]) for case in error_cases)
    return report
