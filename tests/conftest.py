"""Shared test configuration.

Backends are imported directly by their test modules: a missing framework is a
collection error, never a skip, because CI installs every backend and a
skipped backend test would hide a gap.
"""

from __future__ import annotations

import os

# Two xdist workers share two cores: one intra-op thread each avoids
# oversubscription (set before any framework is imported).
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
