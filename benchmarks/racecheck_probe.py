"""Is a racecheck failure ATOM's or the sanitizer's? One kernel per run under racecheck:

    compute-sanitizer --tool racecheck python benchmarks/racecheck_probe.py add|sum|rms_norm

`add` is a Triton vector add (no shared memory), `sum` a Triton row reduction (shared memory),
`rms_norm` ATOM's fused kernel. Exits 0 when the kernel's result is right.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _add(x, y, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=keep) + tl.load(y + offs, mask=keep), mask=keep)


@triton.jit
def _row_sum(x, out, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    values = tl.load(x + row * cols + offs, mask=offs < cols, other=0.0)
    tl.store(out + row, tl.sum(values, axis=0))


def main(which: str) -> None:
    x = torch.randn(64, 2048, device="cuda")
    if which == "add":
        out = torch.empty_like(x)
        _add[(x.numel() // 1024,)](x, x, out, x.numel(), BLOCK=1024)
        torch.testing.assert_close(out, 2 * x)
    elif which == "sum":
        out = torch.empty(64, device="cuda")
        _row_sum[(64,)](x, out, 2048, BLOCK=2048)
        torch.testing.assert_close(out, x.sum(1), rtol=1e-4, atol=1e-3)
    else:
        from atom.model_ops.fused_kernels import rms_norm

        weight = torch.randn(2048, device="cuda")
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        torch.testing.assert_close(rms_norm(x, weight, 1e-6), expected, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    print(which, "ok")


if __name__ == "__main__":
    main(sys.argv[1])
