"""Is a racecheck failure ATOM's or the sanitizer's? One kernel per run under racecheck:

    compute-sanitizer --tool racecheck python benchmarks/racecheck_probe.py WHICH

`add` is a Triton vector add (no shared memory), `sum` a Triton row reduction (shared memory),
`rms_norm` ATOM's fused kernel, `matmul_bf16` and `matmul_fp32` a cuBLAS GEMM of the tiny test
model's shape (bf16 takes Hopper's tensor-core kernels, fp32 without TF32 the plain ones).
Exits 0 when the result is right.
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
    elif which.startswith("matmul"):
        torch.backends.cuda.matmul.allow_tf32 = False
        dtype = torch.bfloat16 if which == "matmul_bf16" else torch.float32
        a, b = x[:20, :64].to(dtype), torch.randn(64, 192, device="cuda", dtype=dtype)
        torch.testing.assert_close(a @ b, (a.double() @ b.double()).to(dtype), rtol=2e-2, atol=2e-2)
    else:
        from atom.model_ops.fused_kernels import rms_norm

        weight = torch.randn(2048, device="cuda")
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        torch.testing.assert_close(rms_norm(x, weight, 1e-6), expected, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    print(which, "ok")


if __name__ == "__main__":
    main(sys.argv[1])
