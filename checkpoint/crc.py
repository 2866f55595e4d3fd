"""CRC-32 (the zlib polynomial) of a buffer, as cheaply as this machine allows.

Checksumming is most of the writer's CPU time: the system zlib (1.2.x) computes CRC-32 at
~3 GB/s per core on an idle core and ~1 GB/s on a busy one, so on a two-core machine the
checksums of a checkpoint cost more CPU than copying it and compete with training for it.
``libdeflate`` computes the *same* CRC-32 with carry-less multiplication (PCLMUL/VPCLMUL)
at ~14 GB/s per core measured here. When the shared library is installed (Debian/Ubuntu
package ``libdeflate0``, a dependency of libtiff and therefore present on most hosts) it is
used through ctypes, which releases the GIL for the call; otherwise ``zlib.crc32`` (which
also releases the GIL for large buffers). Both give identical values; the manifest format
does not change. ``TRAINGUARD_CKPT_CRC=zlib`` forces the fallback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import zlib
from collections.abc import Callable


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer``; only ``buf`` and ``len`` are read."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _load_libdeflate() -> Callable[[int, int, int], int] | None:
    if os.environ.get("TRAINGUARD_CKPT_CRC", "").lower() == "zlib":
        return None
    name = ctypes.util.find_library("deflate")
    try:
        lib = ctypes.CDLL(name or "libdeflate.so.0")
        fn = lib.libdeflate_crc32
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    probe = b"trainguard"
    if fn(0, ctypes.c_char_p(probe), len(probe)) != zlib.crc32(probe):
        return None  # not the CRC we store; never trust it
    return fn


_LIBDEFLATE = _load_libdeflate()
_GET_BUFFER = ctypes.pythonapi.PyObject_GetBuffer
_GET_BUFFER.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_GET_BUFFER.restype = ctypes.c_int
_RELEASE = ctypes.pythonapi.PyBuffer_Release
_RELEASE.argtypes = [ctypes.POINTER(_PyBuffer)]
_RELEASE.restype = None
_PYBUF_SIMPLE = 0

#: Which implementation :func:`crc32` uses ("libdeflate" or "zlib"), for logs and benches.
IMPLEMENTATION = "libdeflate" if _LIBDEFLATE is not None else "zlib"


def crc32(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, computed by libdeflate when available.

    ``data`` must be C-contiguous (any memoryview slice of a buffer is). Read-only buffers
    (the writer process maps the shared host buffer read-only) work too: the address comes
    from the buffer protocol, not from ``ctypes.from_buffer``.
    """
    fn = _LIBDEFLATE
    if fn is None or len(data) < 4096:
        return zlib.crc32(data, value)
    view = _PyBuffer()
    if _GET_BUFFER(data, ctypes.byref(view), _PYBUF_SIMPLE) != 0:  # pragma: no cover
        return zlib.crc32(data, value)
    try:
        return fn(value, view.buf, view.len)
    finally:
        _RELEASE(ctypes.byref(view))
