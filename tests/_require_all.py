"""A pytest hook: under ``DAMCHA_REQUIRE_ALL_BACKENDS=1`` a skip for a missing dependency fails.

A skip for a missing dependency (``pytest.importorskip``, a ``skipif`` on ``find_spec``) is a
failure where every dependency is required (``make test``, CI): such a skip would hide a gap, as
tests/conftest.py says of backends. Elsewhere (a numpy-only checkout running the core's tests) it
stays a skip. tests/conftest.py imports the hook; tests/test_require_all.py runs it on a probe.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

_MISSING_DEPENDENCY = re.compile(r"could not import|No module named|not installed", re.IGNORECASE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or os.environ.get("DAMCHA_REQUIRE_ALL_BACKENDS") != "1" or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if _MISSING_DEPENDENCY.search(str(reason)):
        report.outcome = "failed"
        report.longrepr = f"skipped for a missing dependency, which DAMCHA_REQUIRE_ALL_BACKENDS=1 requires: {reason}"
