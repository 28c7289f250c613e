"""Fused elementwise kernels in Triton: RMSNorm (+ residual add), neox rotary on q and k (alone,
or with the paged KV-cache write of k and v: one launch fewer per layer), and SiLU-and-mul, one
launch each.

At decode batch sizes these ops move a few kilobytes each, so the GPU time of their PyTorch
versions is launch latency: RMSNorm alone is about six kernels. Each kernel here reads its
inputs once and writes its outputs once, in the numerics of the PyTorch code it replaces (the
`forward` of `RMSNorm`, `RotaryEmbedding` and `SiluAndMul`, the reference and the CPU path):

- RMSNorm: the residual sum is rounded to the input dtype before it is normalized (as
  `x + residual` is); fp32 sum of squares, `rsqrt`, a round to the input dtype, then the
  product with the weight in fp32, rounded once to the promoted dtype of input and weight (as
  PyTorch's `weight * x.to(dtype)` is). Differences: the order of the fp32 sum and GPU `rsqrt`
  give a few fp32 ulps, so the rounding to the input dtype rarely flips by one ulp, which the
  weight product can make two ulps of the 16-bit result. The residual sum is bit-identical.
- Rotary: `x1 * cos - x2 * sin` and `x2 * cos + x1 * sin` in fp32, launched with FMA
  contraction off so that each product is rounded as PyTorch rounds it: on a GPU the result is
  bit-identical to PyTorch's.
- SiLU-and-mul: `gate / (1 + exp(-gate))` in fp32, rounded to the input dtype (as `F.silu`
  is), times `up` in fp32, rounded once. Triton's `exp` and division are the fast GPU forms, a
  few fp32 ulps off PyTorch's, so the SiLU rounding rarely flips by one ulp, which the product
  with `up` can make two ulps of a 16-bit result.

CUDA-graph contract: launch shapes come from tensor shapes only, outputs are new tensors, and
nothing is read on the host. Inputs may be strided views (e.g. the q/k/v split of the fused qkv
projection) as long as their last dimension is contiguous. Set `TRITON_INTERPRET=1` before triton
is first imported to run the kernels on CPU tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never call the kernels
    triton = None
    tl = None

__all__ = [
    "fused_add_rms_norm",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_store_kv",
    "silu_and_mul",
]

_NORM_TILE = 2048  # elements per RMSNorm program: several short rows (per-head norms) share one
_SILU_BLOCK = 1024  # output columns per SiLU-and-mul program


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _warps(elements: int) -> int:
    """About 256 elements of a tile per warp (a 16-byte vector per thread for 16-bit types): a
    power of two from 1 to 16."""
    return min(16, max(1, _pow2(elements) // 256))


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, heads, eps,
        stride_xt, stride_xh, stride_rt, stride_rh,
        DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr,
    ):  # fmt: skip
        # Grid: (cdiv(n_rows, ROWS),). Row r is token r // heads, head r % heads of a strided
        # input; outputs are contiguous [n_rows, DIM].
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, D_PAD)
        col_ok = cols < DIM
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        token, head = rows // heads, rows % heads
        x_off = (token * stride_xt + head * stride_xh)[:, None] + cols[None, :]
        out_off = rows[:, None] * DIM + cols[None, :]
        x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
        if HAS_RES:
            r_off = (token * stride_rt + head * stride_rh)[:, None] + cols[None, :]
            r = tl.load(res_ptr + r_off, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + out_off, x, mask=mask)
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / DIM + eps)
        normed = (xf * inv_rms[:, None]).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = normed.to(tl.float32) * w[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_heads(
        src_ptr, dst_row, token, stride_t, stride_h, cos, sin, stored,
        HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        # All heads of one token: [H_PAD, HALF_PAD] tiles of each half; the first ``stored``
        # heads (all or none) are stored at dst_row, the token's heads side by side.
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, HALF_PAD)[None, :]
        mask = (h < HEADS) & (d < HALF)
        src = src_ptr + token * stride_t + h * stride_h + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = dst_row + h * (2 * HALF) + d
        out_ty = dst_row.dtype.element_ty
        out_mask = (h < stored) & (d < HALF)
        tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=out_mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=out_mask)

    @triton.jit
    def _cos_sin(
        pos_ptr, cache_ptr, token, stride_cache, HALF: tl.constexpr, HALF_PAD: tl.constexpr
    ):
        # cos and sin of the token's position, as [1, HALF_PAD] fp32 rows.
        pos = tl.load(pos_ptr + token).to(tl.int64)
        d = tl.arange(0, HALF_PAD)
        row = cache_ptr + pos * stride_cache + d
        cos = tl.load(row, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(row + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        return cos, sin

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
        HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        # Grid: (token,). cos/sin of the token's position are loaded once for q and k.
        token = tl.program_id(0).to(tl.int64)
        cos, sin = _cos_sin(pos_ptr, cache_ptr, token, stride_cache, HALF, HALF_PAD)
        _rotate_heads(q_ptr, q_out_ptr + token * (HQ * 2 * HALF), token, stride_qt, stride_qh,
                      cos, sin, HQ, HQ, HQ_PAD, HALF, HALF_PAD)  # fmt: skip
        _rotate_heads(k_ptr, k_out_ptr + token * (HK * 2 * HALF), token, stride_kt, stride_kh,
                      cos, sin, HK, HK, HK_PAD, HALF, HALF_PAD)  # fmt: skip

    @triton.jit
    def _rotary_store_kv_kernel(
        q_ptr, k_ptr, v_ptr, q_out_ptr, pos_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_cache,
        stride_cb, stride_ct, page_size,
        HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    ):  # fmt: skip
        # Grid: (token,). q rotated into q_out; k rotated and v copied straight into the paged
        # cache at the token's slot (a negative slot, a padding row, writes nothing there).
        token = tl.program_id(0).to(tl.int64)
        cos, sin = _cos_sin(pos_ptr, cache_ptr, token, stride_cache, HALF, HALF_PAD)
        _rotate_heads(q_ptr, q_out_ptr + token * (HQ * 2 * HALF), token, stride_qt, stride_qh,
                      cos, sin, HQ, HQ, HQ_PAD, HALF, HALF_PAD)  # fmt: skip
        slot = tl.load(slots_ptr + token).to(tl.int64)
        write = slot >= 0
        slot = tl.maximum(slot, 0)
        at = (slot // page_size) * stride_cb + (slot % page_size) * stride_ct
        _rotate_heads(k_ptr, k_cache_ptr + at, token, stride_kt, stride_kh,
                      cos, sin, tl.where(write, HK, 0), HK, HK_PAD, HALF, HALF_PAD)  # fmt: skip
        i = tl.arange(0, KV_PAD)
        ok = i < tl.where(write, HK * 2 * HALF, 0)
        tl.store(v_cache_ptr + at + i, tl.load(v_ptr + token * stride_vt + i, mask=ok), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, stride_xt, WIDTH: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        # Grid: (token, column block). Gate is x[t, :WIDTH], up is x[t, WIDTH:]; out is
        # contiguous [T, WIDTH].
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < WIDTH
        row = x_ptr + token * stride_xt + cols
        gate = tl.load(row, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(row + WIDTH, mask=ok, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
        out = silu.to(tl.float32) * up
        tl.store(out_ptr + token * WIDTH + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows_and_strides(x: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(heads, token stride, head stride) of a [T, D] or [T, H, D] input read as T * H rows."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, D] or [T, H, D] with a contiguous last dimension")
    if x.dim() == 2:
        return 1, x.stride(0), 0
    return x.size(1), x.stride(0), x.stride(1)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check shapes, allocate contiguous outputs and run `_rms_norm_kernel`."""
    dim = x.size(-1)
    if weight.shape != (dim,) or weight.stride(0) != 1:
        raise ValueError("weight must be a contiguous vector of the last dimension's size")
    heads, stride_xt, stride_xh = _rows_and_strides(x, "x")
    sum_dtype = x.dtype
    res_out, stride_rt, stride_rh = None, 0, 0
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError("residual must have the shape of x")
        _, stride_rt, stride_rh = _rows_and_strides(residual, "residual")
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    n_rows = x.size(0) * heads
    if n_rows == 0:
        return out, res_out
    d_pad = _pow2(dim)
    rows = max(1, _NORM_TILE // d_pad)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x, x if residual is None else residual, weight, out, out if res_out is None else res_out,
        n_rows, heads, eps, stride_xt, stride_xh, stride_rt, stride_rh,
        dim, d_pad, rows, residual is not None, num_warps=_warps(rows * d_pad),
    )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [T, D] or [T, H, D] -> a new contiguous tensor."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass; the inputs are left unchanged."""
    out, res_out = _launch_rms_norm(x, residual, weight, eps)
    return out, res_out


def _check_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.size(0) != k.size(0) or q.size(2) != k.size(2):
        raise ValueError("q and k must be [T, H, D] with the same T and D")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must have a contiguous head dimension")
    if positions.shape != (q.size(0),):
        raise ValueError("positions must hold one position per token")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.size(1) != q.size(2) or q.size(2) % 2:
        raise ValueError("cos_sin_cache must be [max_position, D] with an even D")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must have a contiguous last dimension")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary (rotate halves) of q [T, Hq, D] and k [T, Hk, D], both possibly strided views,
    at `positions` [T]; cos/sin are the halves of `cos_sin_cache[position]`. -> new contiguous
    (q, k) in the inputs' dtypes. Positions are not bounds-checked (a host check would sync)."""
    _check_rotary(positions, q, k, cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tokens, hq, d = q.shape
    hk = k.size(1)
    if tokens == 0:
        return q_out, k_out
    half = d // 2
    _rotary_kernel[(tokens,)](
        q, k, q_out, k_out, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        hq, _pow2(hq), hk, _pow2(hk), half, _pow2(half),
        num_warps=_warps(d * max(hq, hk)), enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out


def rotary_embedding_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``rotary_embedding`` of q and k and the paged cache write of the rotated k and of v
    [T, Hk, D] (heads side by side) at ``slot_mapping`` [T] (negative: skipped) in one launch;
    -> the new contiguous rotated q. The caches are [blocks, block_size, Hk, D], one layout."""
    _check_rotary(positions, q, k, cos_sin_cache)
    tokens, hq, d = q.shape
    hk = k.size(1)
    if v.shape != k.shape or v.stride(2) != 1 or v.stride(1) != d:
        raise ValueError("v must be [T, Hk, D] like k, its heads side by side")
    if k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != (hk, d):
        raise ValueError("k_cache and v_cache must share a [blocks, block_size, Hk, D] layout")
    if k_cache.stride()[2:] != (d, 1) or k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        raise ValueError("cache rows must hold their heads side by side, in k/v's dtype")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    half = d // 2
    _rotary_store_kv_kernel[(tokens,)](
        q, k, v, q_out, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.size(1),
        hq, _pow2(hq), hk, _pow2(hk), half, _pow2(half), _pow2(hk * d),
        num_warps=_warps(d * max(hq, hk)), enable_fp_fusion=False,
    )  # fmt: skip
    return q_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x[:, :I]) * x[:, I:] of the merged gate/up projection x [T, 2I] -> new [T, I]."""
    if x.dim() != 2 or x.size(1) % 2 or x.stride(1) != 1:
        raise ValueError("x must be [T, 2I] with a contiguous last dimension")
    tokens, width = x.size(0), x.size(1) // 2
    out = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block = min(_SILU_BLOCK, _pow2(width))
    grid = (tokens, triton.cdiv(width, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), width, block, num_warps=_warps(block))
    return out
