"""A pytest plugin: the conformance catalogue as pytest tests, one per check.

A third party points it at their adapter::

    pytest -p damcha_conformance.pytest_plugin --damcha-adapter my_port.conformance:MyAdapter

(the plugin is also registered as a ``pytest11`` entry point, so once damcha
is installed ``pytest --damcha-adapter ...`` is enough). Each check is one
test, ``damcha-conformance::<check>-<dtype>-<case>`` (``forward``,
``gradients``, ``decode``, ``weights``, ``penalty``, ``penalty-gradients``,
``errors`` for the bad-input checks), so ``-k`` selects
them: ``-k "gradients and bfloat16"``, ``-k masks`` (a check's group is a
keyword too: the case's, or ``weights``/``penalty``). Options:

- ``--damcha-adapter SPEC``: ``module:attr`` (a class, factory or instance)
  or a built-in backend name (``torch``, ``jax``, ...).
- ``--damcha-dtype DTYPE``: only these dtypes (repeatable; default: the
  adapter's ``dtypes``).
- ``--damcha-no-gradients``: outputs only.
- ``--damcha-no-weights``, ``--damcha-no-penalty``: leave out the attention
  weights / metric penalty checks (a port that has neither, or an adapter
  written before those groups: not collected, rather than failing as
  unsupported).
- ``--damcha-xfails FILE``: the checks the port knows it fails, one id (or
  ``fnmatch`` pattern) per line, ``# reason`` optional; they are reported as
  xfail, and a listed check that passes as XPASS (remove it from the file).
  ``errors-<case>``, the id of the bad-input checks when they ran in the
  first dtype only, still matches that case's checks in every dtype.

Cases the adapter declares unsupported, and gradients of an adapter with
``supports_gradients=False``, are skipped with the reason. A session in
which no check ran fails. The terminal summary prints the same table and
verdict as ``damcha conform`` (which stays the conformance claim: there,
a run that skipped anything is PARTIAL).

For a project's own tests, ``checks()`` and ``assert_check()`` give the
same parametrisation without the command-line options::

    @pytest.mark.parametrize("check", checks(TorchAdapter.dtypes), ids=check_id)
    def test_conformance(check, adapter):
        assert_check(adapter, check)
"""

from __future__ import annotations

import fnmatch
import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from ._adapter import BackendAdapter
    from ._runner import Check, Result

__all__ = ["assert_check", "check_id", "checks", "read_xfails"]

_RESULT_KEY = "damcha_conformance_result"


def checks(
    dtypes: Sequence[str],
    *,
    cases: Iterable[Any] | None = None,
    gradients: bool = True,
    decoding: bool = True,
    errors: bool = True,
    weights: bool = True,
    penalty: bool = True,
) -> list[Check]:
    """The checks of the catalogue in ``dtypes``: forward (and gradients, for
    cases that have them) of every case that runs in the dtype (``Case.dtypes``),
    the decode cases, the attention weights of ``WEIGHTS_CASES``, the metric
    penalty of ``PENALTY_CASES`` (and its gradients), then the bad-input cases
    in every dtype, after all the others (as ``run_conformance`` orders them). The
    order lets adapters reuse a case's forward computation for its gradients."""
    from ._cases import CATALOGUE, DECODE_CATALOGUE, ERROR_CATALOGUE, PENALTY_CASES, WEIGHTS_CASES, resolve_cases
    from ._runner import Check, check_dtype_names
    from ._tolerances import tolerance

    dtypes = check_dtype_names(dtypes)
    for dtype in dtypes:
        tolerance(dtype)
    chosen = CATALOGUE if cases is None else resolve_cases(cases, CATALOGUE, "cases")
    out: list[Check] = []
    for dtype in dtypes:
        for case in chosen:
            if not case.runs_in(dtype):
                continue
            out.append(Check("forward", case, dtype))
            if gradients and case.gradients:
                out.append(Check("gradients", case, dtype))
        if decoding:
            out += [Check("decode", case, dtype) for case in DECODE_CATALOGUE]
        if weights:
            out += [Check("weights", case, dtype) for case in WEIGHTS_CASES if case.runs_in(dtype)]
        if penalty:
            for case in PENALTY_CASES:
                if case.runs_in(dtype):
                    out.append(Check("penalty", case, dtype))
                    if gradients and case.gradients:
                        out.append(Check("penalty-gradients", case, dtype))
    if errors:
        out += [Check("errors", case, dtype) for dtype in dtypes for case in ERROR_CATALOGUE]
    return out


def check_id(check: Check) -> str:
    """The test id of ``check`` (``forward-float32-heads-tied-self``)."""
    return check.id


def assert_check(adapter: BackendAdapter, check: Check, *, allow_unsupported: bool = False) -> Result:
    """Run ``check`` on ``adapter``; fail the test with the runner's verdict
    and detail unless it passes. A check the adapter declares unsupported is
    skipped with its reason when ``allow_unsupported``, else it fails (a
    project's own port must claim every case)."""
    from ._runner import Report

    result = check.run(adapter)
    if result.status == "unsupported":
        if allow_unsupported:
            pytest.skip(f"unsupported by {adapter.name}: {result.detail}")
        pytest.fail(f"{adapter.name} declares {check.id} unsupported: {result.detail}", pytrace=False)
    if result.status != "pass":
        pytest.fail(Report([result]).summary().splitlines()[-1], pytrace=False)
    return result


def read_xfails(path: str | Path) -> dict[str, str]:
    """The xfails file: ``{id or pattern: reason}``, one per line; blank lines
    and lines starting with ``#`` are skipped, ``# reason`` may follow an id."""
    entries: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        text, _, reason = line.partition("#")
        text = text.strip()
        if text:
            entries[text] = reason.strip() or "listed in the xfails file"
    return entries


def _xfail_ids(check: Check) -> tuple[str, ...]:
    """The ids an xfails entry may name ``check`` by: its short and full id and, for a bad-input
    check, ``errors-<case>``, its id when those checks ran in the first dtype only (an xfails file
    written then keeps matching, now in every dtype)."""
    ids: tuple[str, ...] = (check.id, f"damcha-conformance::{check.id}")
    if check.kind == "errors":
        old = f"errors-{check.case.name}"
        ids += (old, f"damcha-conformance::{old}")
    return ids


# ---------------------------------------------------------------- the hooks


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("damcha", "damcha conformance (damcha_conformance.pytest_plugin)")
    group.addoption(
        "--damcha-adapter",
        metavar="SPEC",
        default=None,
        help="run the conformance catalogue on this adapter: module:attr or a built-in backend name",
    )
    group.addoption(
        "--damcha-dtype",
        action="append",
        default=None,
        metavar="DTYPE",
        help="only these dtypes (repeatable; default: the adapter's own)",
    )
    group.addoption("--damcha-no-gradients", action="store_true", default=False, help="check outputs only")
    group.addoption(
        "--damcha-no-weights", action="store_true", default=False, help="leave out the attention-weights checks"
    )
    group.addoption(
        "--damcha-no-penalty", action="store_true", default=False, help="leave out the metric-penalty checks"
    )
    group.addoption(
        "--damcha-xfails",
        metavar="FILE",
        default=None,
        help="checks the port is known to fail: one test id or fnmatch pattern per line, '# reason'",
    )


class _Session:
    """The plugin's hooks for a session run with ``--damcha-adapter``
    (registered by ``pytest_configure``; also in the xdist controller, which
    gathers the results the workers send as user properties)."""

    def __init__(self, adapter: Any, checks: list[Check], xfails: dict[str, str]) -> None:
        self.adapter, self.checks, self.xfails = adapter, checks, xfails
        self.results: list[dict[str, Any]] = []
        self.xpassed: list[str] = []

    @pytest.hookimpl(tryfirst=True)  # before -k and --deselect filter the items
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        matched: set[str] = set()
        for check in self.checks:
            item = ConformanceItem.from_parent(
                session, name=check.id, nodeid=f"damcha-conformance::{check.id}", check=check
            )
            for pattern, reason in self.xfails.items():
                # The short id or the full one (as --collect-only prints it), as a pattern or, for
                # ids whose brackets fnmatch reads as character classes, exactly.
                if pattern == item.nodeid or any(fnmatch.fnmatchcase(i, pattern) for i in _xfail_ids(check)):
                    item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
                    matched.add(pattern)
            items.append(item)
        # pytest counts what its collectors report, and these items come from no collector:
        # --collect-only said "no tests collected" under the ids it had just listed.
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and isinstance(getattr(reporter, "_numcollected", None), int):
            reporter._numcollected += len(self.checks)
        unknown = [p for p in self.xfails if p not in matched]
        if unknown:
            warnings.warn(
                pytest.PytestWarning(
                    f"--damcha-xfails: {len(unknown)} entries match no check: {', '.join(unknown[:10])}"
                ),
                stacklevel=1,
            )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for key, value in report.user_properties:
            if key == _RESULT_KEY:
                self.results.append(json.loads(str(value)))  # stored by runtest as a JSON string
                if report.passed and hasattr(report, "wasxfail"):
                    self.xpassed.append(report.nodeid.split("::", 1)[-1])

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller judges
            return
        if session.config.option.collectonly:
            # Listing the ids (to write a --damcha-xfails file) checks nothing by design; pytest counts
            # only what its collectors report, so it read the plugin's items as "no tests collected".
            if self.checks and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
                session.exitstatus = pytest.ExitCode.OK
            return
        if not any(r["status"] != "unsupported" for r in self.results) and session.exitstatus in (
            pytest.ExitCode.OK,
            pytest.ExitCode.NO_TESTS_COLLECTED,
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a run that checked nothing does not pass

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        from ._runner import Report, Result, prefill_gaps

        # Gradients of an adapter without them are said once below, not counted in the table as
        # unsupported cases (its legend: 'unsup' counts cases the backend declares it cannot run).
        report = Report(
            [
                Result(**r)
                for r in self.results
                if not r["check"].endswith("gradients")
                or r["status"] != "unsupported"
                or self.adapter.supports_gradients
            ]
        )
        tr, name = terminalreporter, self.adapter.name
        tr.section("damcha conformance")
        if config.option.collectonly:
            tr.write_line(f"{len(self.checks)} conformance checks of {name} collected (none run: --collect-only)")
            return
        tr.write_line(report.table())
        ran = [r for r in report.results if r.status != "unsupported"]
        skipped = sum(r.status == "unsupported" for r in report.results)
        if self.xpassed:
            tr.write_line(
                f"XPASS: {len(self.xpassed)} checks listed in --damcha-xfails now pass (remove them): "
                + ", ".join(sorted(self.xpassed)[:20])
            )
        if not ran:
            tr.write_line(f"FAILED: nothing checked on {name}")
            return
        gaps = []
        if report.failures():
            gaps.append(f"{len(report.failures())} checks failed (known failures included)")
        if skipped:
            gaps.append(f"{skipped} checks unsupported by the adapter")
        if not self.adapter.supports_gradients:
            gaps.append("no gradients (supports_gradients=False)")
        gaps += [what for _, what in prefill_gaps(name, report.results)]
        if gaps:
            tr.write_line(f"not conformant: {name}: " + "; ".join(gaps))
        else:
            tr.write_line(f"every check that ran passed on {name} ('damcha conform' gives the conformance verdict)")


def pytest_configure(config: pytest.Config) -> None:
    spec = config.getoption("damcha_adapter", None)
    if spec is None:
        for flag in ("damcha_dtype", "damcha_xfails"):
            if config.getoption(flag, None):
                raise pytest.UsageError(f"--{flag.replace('_', '-')} needs --damcha-adapter")
        return
    from damcha_core import DamchaError

    from .adapters import load_adapter

    try:
        adapter = load_adapter(spec)
    except DamchaError as exc:
        raise pytest.UsageError(f"--damcha-adapter: {exc}") from None
    declared = list(adapter.dtypes)
    dtypes = config.getoption("damcha_dtype") or declared
    undeclared = [d for d in dtypes if d not in declared]
    if undeclared:
        raise pytest.UsageError(
            f"--damcha-dtype: {', '.join(undeclared)} not among the adapter's dtypes ({', '.join(declared)})"
        )
    planned = checks(
        list(dict.fromkeys(dtypes)),
        gradients=not config.getoption("damcha_no_gradients"),
        decoding=True,
        errors=True,
        weights=not config.getoption("damcha_no_weights"),
        penalty=not config.getoption("damcha_no_penalty"),
    )
    xfails: dict[str, str] = {}
    path = config.getoption("damcha_xfails")
    if path is not None:
        try:
            xfails = read_xfails(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise pytest.UsageError(f"--damcha-xfails: cannot read {path!r}: {exc}") from None
    config.pluginmanager.register(_Session(adapter, planned, xfails), "damcha-conformance-session")
    config.addinivalue_line("markers", "damcha_conformance: a check of the damcha conformance catalogue")
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args[:] = []  # no paths given: run the conformance checks alone, not the folder's own tests


class ConformanceItem(pytest.Item):
    """One check of the catalogue on the session's adapter."""

    def __init__(self, *, check: Check, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.add_marker("damcha_conformance")
        self.extra_keyword_matches.add(check.group)  # -k masks selects the group's cases, -k weights those checks

    def runtest(self) -> None:
        session = self.config.pluginmanager.get_plugin("damcha-conformance-session")
        assert session is not None  # registered at configure time whenever these items are collected
        result = self.check.run(session.adapter)
        self.user_properties.append((_RESULT_KEY, json.dumps(result.to_dict())))
        if result.status == "unsupported":
            pytest.skip(f"unsupported by {session.adapter.name}: {result.detail}")
        if result.status != "pass":
            from ._runner import Report

            raise ConformanceFailure(Report([result]).summary().splitlines()[-1])

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"damcha conformance: {self.check.id}"


class ConformanceFailure(AssertionError):
    """A check that ran and did not pass (its message is the runner's line)."""
