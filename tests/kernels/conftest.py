"""Kernel tests: native implementations against Triton's interpreter running vLLM's own kernels.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` runs (i.e. before a vLLM kernel module is
imported), so it is set here, at collection, for the whole test process; the patched vLLM (patches/0004) then
reports HAS_TRITON. The reference is the interpreter as ``MMCPU_KERNELS=interpreter`` runs it: with the gaps
:mod:`mmcpu.kernels.interpreter` fills (PyPI triton's ``libdevice`` stub, whose ``log1p`` returns None;
``tl.range`` yielding ints in ``_topk_topp_kernel``), applied around every test by ``interpreter_gaps``. A test
that must see triton's own interpreter asks for ``raw_interpreter``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest


@pytest.fixture
def raw_interpreter():
    """Triton's interpreter without the product's gaps filled (for tests of the filling itself)."""


@pytest.fixture(autouse=True)
def interpreter_gaps(request):
    """The product's interpreter fixes for the test, put back after it (nested applies, e.g. the dispatcher's
    install, compose with it)."""
    if "raw_interpreter" in request.fixturenames:
        yield
        return
    from mmcpu.kernels import interpreter

    with interpreter.applied():
        yield


@pytest.fixture(autouse=True)
def pointer_tables_untouched():
    """No kernel may write into a pointer table (diff.pointer_table / track_pointer_table)."""
    from diff import PTR_TABLES

    PTR_TABLES.clear()
    yield
    assert all(t.equal(orig) for t, orig in PTR_TABLES), "a kernel wrote into a pointer table"
    PTR_TABLES.clear()
