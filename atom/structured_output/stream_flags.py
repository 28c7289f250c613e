"""A CUDA stream waiting on and writing 64-bit counters in page-locked host memory.

These are the driver's stream memory operations (``cuStreamWaitValue64``,
``cuStreamWriteValue64``), which torch does not expose, so they are called through ctypes. A
wait holds back the work queued after it on that stream until the host (or another stream)
has raised the counter; a write lands after the work queued before it, with a memory fence, so
whoever sees the new value also sees what that work wrote. Used by ``grammar_board``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

__all__ = ["stream_wait", "stream_write"]

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced after the stream's earlier work


@functools.lru_cache(maxsize=1)
def _driver() -> tuple[Any, Any, Any]:
    lib = ctypes.CDLL("libcuda.so.1")

    def function(name: str) -> Any:
        for symbol in (name + "_v2", name):  # the _v2 forms need no driver opt-in
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return fn
        raise RuntimeError(f"the CUDA driver has no {name}")

    wait, write = function("cuStreamWaitValue64"), function("cuStreamWriteValue64")
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    pointer = function("cuMemHostGetDevicePointer")
    pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    return wait, write, pointer


@functools.lru_cache(maxsize=64)
def _device_address(host_address: int) -> int:
    _, _, pointer = _driver()
    device = ctypes.c_uint64()
    _check(pointer(ctypes.byref(device), ctypes.c_void_p(host_address), 0), "device pointer")
    return device.value


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver error {code} in {what}")


def stream_wait(stream: torch.cuda.Stream, host_address: int, value: int) -> None:
    """Work queued on ``stream`` after this waits until the counter reaches ``value``."""
    wait, _, _ = _driver()
    address = _device_address(host_address)
    _check(wait(stream.cuda_stream, address, value, _WAIT_GEQ), "cuStreamWaitValue64")


def stream_write(stream: torch.cuda.Stream, host_address: int, value: int) -> None:
    """Once the work queued on ``stream`` before this is done, the counter becomes ``value``."""
    _, write, _ = _driver()
    address = _device_address(host_address)
    _check(write(stream.cuda_stream, address, value, _WRITE_DEFAULT), "cuStreamWriteValue64")
