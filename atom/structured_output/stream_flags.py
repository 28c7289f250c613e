"""A CUDA stream waiting on and writing 64-bit counters in page-locked host memory, and the
page-locking of that memory.

These are the driver's stream memory operations (``cuStreamWaitValue64``,
``cuStreamWriteValue64``), which torch does not expose, so they are called through ctypes. A
wait holds back the work queued after it on that stream until the host (or another stream)
has raised the counter; a write lands after the work queued before it, with a memory fence, so
whoever sees the new value also sees what that work wrote. Used by ``grammar_board``.

Streams are passed as their driver handles (``current_stream_handle``): a gate needs the handle
only, and building torch's ``Stream`` object for it took 9 µs of the engine thread per gate on
the H200's host (benchmarks/bench_gate_ops.py).

Page-locking goes through the driver too (``host_register``): the runtime's
``cudaHostRegister`` that torch exposes leaves a failure in the runtime's last error, which the
next torch call on that thread then raises as its own.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, NamedTuple

import torch

__all__ = [
    "current_stream_handle",
    "host_register",
    "host_unregister",
    "stream_wait",
    "stream_write",
]

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced after the stream's earlier work
_REGISTER_MAPPED = 0x3  # CU_MEMHOSTREGISTER_PORTABLE | _DEVICEMAP: what cudaHostRegister does


class _Driver(NamedTuple):
    wait: Any
    write: Any
    pointer: Any
    register: Any
    unregister: Any


@functools.lru_cache(maxsize=1)
def _driver() -> _Driver:
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
    register, unregister = function("cuMemHostRegister"), function("cuMemHostUnregister")
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    unregister.argtypes = [ctypes.c_void_p]
    return _Driver(wait, write, pointer, register, unregister)


@functools.lru_cache(maxsize=64)
def _device_address(host_address: int) -> int:
    device = ctypes.c_uint64()
    pointer = _driver().pointer
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
    address = _device_address(host_address)
    _check(_driver().wait(stream, address, value, _WAIT_GEQ), "cuStreamWaitValue64")


def stream_write(stream: int, host_address: int, value: int) -> None:
    """Once the work queued on stream handle ``stream`` before this is done, the counter
    becomes ``value``."""
    address = _device_address(host_address)
    _check(_driver().write(stream, address, value, _WRITE_DEFAULT), "cuStreamWriteValue64")


def host_register(device: torch.device, host_address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``host_address`` for ``device``'s context (made
    current on this thread first: a thread that has not used the device yet has none)."""
    torch.cuda.synchronize(device)
    _check(_driver().register(host_address, nbytes, _REGISTER_MAPPED), "cuMemHostRegister")


def host_unregister(device: torch.device, host_address: int) -> None:
    """Undo ``host_register`` once the device is done with the memory; a later mapping may
    reuse the address, so its device address is looked up again."""
    torch.cuda.synchronize(device)
    _check(_driver().unregister(host_address), "cuMemHostUnregister")
    _device_address.cache_clear()
