"""Which code produced a result, and when: the git commit (with a dirty flag) and UTC times.

A result file that records neither cannot say which version of the
training code made it, nor in which order runs and rule changes happened
(docs/results.md had to cite the commit log for that). ``code_version``
asks git about the repository this package lives in; it never fails: no
git, a package outside a repository (an installed wheel) or any error give
None. The dirty flag covers tracked files only (``git status --porcelain
--untracked-files=no``): run folders and other untracked files beside the
code would otherwise mark every run dirty.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["code_version", "utc_now"]

_PACKAGE_DIR = Path(__file__).resolve().parent
_GIT_TIMEOUT_S = 10.0
# The first answer for this package, kept for the life of the process: the code a process runs is
# the code it imported, whatever is edited in the working tree while it trains.
_cached: dict[str, Any] | None = None
_asked = False


def utc_now() -> str:
    """The current UTC time as ``YYYY-MM-DDTHH:MM:SSZ`` (ISO 8601)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # GIT_OPTIONAL_LOCKS=0: `git status` must not take the index lock from a git command running beside it.
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    return subprocess.run(
        ["git", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False
    )


def _ask_git(folder: Path) -> dict[str, Any] | None:
    try:
        head = _git(folder, "rev-parse", "--verify", "HEAD")
        if head.returncode != 0:
            return None  # not a repository, or one without a commit
        # The folder's files must be tracked there: a package installed into an untracked folder
        # (a virtual environment inside some repository) is not that repository's code.
        if _git(folder, "ls-files", "--error-unmatch", "--", ".").returncode != 0:
            return None
        status = _git(folder, "status", "--porcelain", "--untracked-files=no")
        if status.returncode != 0:
            return None
        commit = head.stdout.strip()
        return {"commit": commit or None, "dirty": bool(status.stdout.strip())} if commit else None
    except Exception:  # noqa: BLE001 - provenance is a record, never a reason for a run to fail
        return None


def code_version(folder: str | Path | None = None) -> dict[str, Any] | None:
    """``{"commit": SHA, "dirty": bool}`` of the git repository holding ``folder``, or None.

    ``folder`` defaults to this package's folder; that answer is asked once per process (see
    ``_cached``). None when git is missing, ``folder`` is not tracked by a repository with a commit,
    or git fails in any way. ``dirty``: some tracked file differs from the commit.
    """
    global _cached, _asked
    if folder is not None:
        return _ask_git(Path(folder))
    if not _asked:
        _cached, _asked = _ask_git(_PACKAGE_DIR), True
    return None if _cached is None else dict(_cached)
