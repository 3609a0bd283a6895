"""Kernel tests: native implementations against Triton's interpreter running vLLM's own kernels.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` runs (i.e. before a vLLM kernel module is
imported), so it is set here, at collection, for the whole test process; the patched vLLM (patches/0004) then
reports HAS_TRITON. The interpreter's ``libdevice`` is a stub on PyPI's triton (``log1p`` returns None, which
is what kills MRV2's sampler in production); for use as a reference its few math functions are filled in with
numpy's (``fill_libdevice``).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def fill_libdevice():
    """Give the interpreter a real libdevice for the functions vLLM's kernels call (reference runs only)."""
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    # The interpreter maps libdevice calls onto numpy through its builder; PyPI's stub returns None instead.
    fills = {"log1p": np.log1p, "isnan": np.isnan, "exp": np.exp, "log": np.log, "exp2": np.exp2}
    saved = {}
    for name, fn in fills.items():
        saved[name] = getattr(libdevice, name, None)
        setattr(libdevice, name, _np_elementwise(interpreter, fn))
    yield
    for name, fn in saved.items():
        if fn is not None:
            setattr(libdevice, name, fn)


def _np_elementwise(interpreter, np_fn):
    """A libdevice-style function for the interpreter: applies ``np_fn`` to a tl.tensor's numpy data."""
    import triton.language as tl

    def call(x, _semantic=None, **_kw):
        data = np_fn(x.handle.data)
        dtype = x.dtype if data.dtype != np.bool_ else tl.int1
        return tl.core.tensor(interpreter.TensorHandle(data.astype(x.handle.data.dtype) if dtype is x.dtype
                                                       else data, dtype.scalar), x.type.with_element_ty(dtype)
                              if x.type.is_block() else dtype)

    return call


@pytest.fixture(autouse=True)
def pointer_tables_untouched():
    """No kernel may write into a pointer table (diff.pointer_table / track_pointer_table)."""
    from diff import PTR_TABLES

    PTR_TABLES.clear()
    yield
    assert all(t.equal(orig) for t, orig in PTR_TABLES), "a kernel wrote into a pointer table"
    PTR_TABLES.clear()
