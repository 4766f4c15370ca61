"""A deliberately wrong third-party adapter, loaded by the CLI test as module:attr."""

from __future__ import annotations

import numpy as np

import damcha_core as dc
from damcha_conformance import ReferenceAdapter


class WrongMask(ReferenceAdapter):
    """Reads the mask with the opposite polarity (True = masked out)."""

    name = "wrong-mask"

    def forward(self, data, dtype):
        mask = None if data.mask is None else ~data.mask
        return np.nan_to_num(
            dc.damcha_attention(
                data.params, data.config, data.query, data.context, mask=mask, causal=data.causal, value=data.value
            )
        )


class Lazy(ReferenceAdapter):
    """Declares every case unsupported: a run of it checks nothing."""

    name = "lazy"

    def unsupported(self, case):
        return "not implemented yet"


class NoGradients(ReferenceAdapter):
    """An honest forward-only port (``supports_gradients=False``): its run is
    partial unless gradients are explicitly not asked for."""

    name = "no-gradients"


class Interrupted(ReferenceAdapter):
    """Stops the run part-way, as Ctrl-C would."""

    name = "interrupted"

    def forward(self, data, dtype):
        if data.case.group == "masks":
            raise KeyboardInterrupt
        return super().forward(data, dtype)


class DtypesString(ReferenceAdapter):
    """``dtypes = "float64"``: iterating it used to run dtypes 'f', 'l', 'o', ..."""

    name = "dtypes-string"
    dtypes = "float64"  # type: ignore[assignment]


class NoUnsupported:
    """Has forward but no ``unsupported``: used to die with an AttributeError fragment."""

    name = "no-unsupported"
    dtypes = ("float64",)
    supports_gradients = False

    def forward(self, data, dtype):
        return ReferenceAdapter().forward(data, dtype)


def make_dtypes_string():
    """A factory: what it builds is only known once called, so the worker checks it."""
    return DtypesString()


def make_no_unsupported():
    return NoUnsupported()


no_unsupported_instance = NoUnsupported()


def needs_an_argument(device):
    """A factory ``load_adapter`` cannot call (it calls with no arguments)."""
    return ReferenceAdapter()


def make_raises():
    """A factory that fails to build (a constructor that needs a device the machine lacks)."""
    raise RuntimeError("no such device: cuda:7")


def make_exits():
    """A factory that ends its process without a word (a library calling sys.exit on a missing device)."""
    import sys

    sys.exit(3)


class UnknownDtype(ReferenceAdapter):
    """``dtypes = ("fp32",)``: not a key of TOLERANCES; the worker used to die with a traceback."""

    name = "unknown-dtype"
    dtypes = ("fp32",)


class GradientsWithoutMethod(NoUnsupported):
    """Claims gradients but has no ``gradients``: every gradient check was an AttributeError."""

    name = "gradients-without-method"
    supports_gradients = True

    def unsupported(self, case):
        return None


class Unnamed(ReferenceAdapter):
    """A port built on ReferenceAdapter that kept its name: it reports as 'reference'."""


class SameNameAsWrongMask(ReferenceAdapter):
    name = "wrong-mask"


class NameNotAString(ReferenceAdapter):
    name = None  # type: ignore[assignment]


def make_slowly():
    """A factory that hangs (a constructor waiting on a device); writes its pid where the test says."""
    import os
    import time

    with open(os.environ["DAMCHA_TEST_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
