"""A CUDA stream waiting on and writing 64-bit counters in page-locked host memory.

These are the driver's stream memory operations (``cuStreamWaitValue64``,
``cuStreamWriteValue64``), which torch does not expose, so they are called through ctypes. A
wait holds back the work queued after it on that stream until the host (or another stream)
has raised the counter; a write lands after the work queued before it, with a memory fence, so
whoever sees the new value also sees what that work wrote. Used by ``grammar_board``.

Streams are passed as their driver handles (``current_stream_handle``): a gate needs the handle
only, and building torch's ``Stream`` object for it took 9 µs of the engine thread per gate on
the H200's host (benchmarks/bench_gate_ops.py).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

__all__ = ["current_stream_handle", "stream_wait", "stream_write"]

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


def current_stream_handle(device: torch.device) -> int:
    """The driver handle of the calling thread's current stream on ``device`` (what
    ``torch.cuda.current_stream(device).cuda_stream`` is, without building the object; the
    same call Triton's launcher makes)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def stream_wait(stream: int, host_address: int, value: int) -> None:
    """Work queued on stream handle ``stream`` after this waits until the counter reaches
    ``value``."""
    wait, _, _ = _driver()
    address = _device_address(host_address)
    _check(wait(stream, address, value, _WAIT_GEQ), "cuStreamWaitValue64")


def stream_write(stream: int, host_address: int, value: int) -> None:
    """Once the work queued on stream handle ``stream`` before this is done, the counter
    becomes ``value``."""
    _, write, _ = _driver()
    address = _device_address(host_address)
    _check(write(stream, address, value, _WRITE_DEFAULT), "cuStreamWriteValue64")
