"""Paged-attention kernels vs the reference: interpreted on CPU (CI) and on a real GPU.

The reference itself is checked in-process against the CPU SDPA path of `Attention`, so the
kernels, the oracle and the CPU engine all agree on one meaning.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

from atom.model_ops import attention
from atom.model_ops.context import AttentionContext, set_context
from atom.model_ops.paged_attention import paged_attention_reference

# Shared by the interpreted and the CUDA checks; DEVICE is defined before it runs.
CHECK = textwrap.dedent(
    """
    import types

    import torch
    from atom.model_ops import attention
    from atom.model_ops.rotary_embedding import RotaryEmbedding
    from atom.model_ops.context import AttentionContext, set_context
    from atom.model_ops.paged_attention import (
        paged_attention_reference as ref, paged_decode_attention, paged_prefill_attention,
        store_kv,
    )

    g = torch.Generator().manual_seed(0)
    TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}
    BAD = 1 << 28  # table entries no kernel may read: far outside the cache


    def batch(ctx_lens, q_lens, hq, hk, d, dtype, page=16, bad=BAD):
        # Random caches; each sequence owns shuffled, non-contiguous blocks; table entries past
        # its context (whole rows for padding) hold `bad`.
        need = [-(-c // page) for c in ctx_lens]
        nb = sum(need) + 5
        kc = torch.randn(nb, page, hk, d, generator=g).to(dtype).to(DEVICE)
        vc = torch.randn(nb, page, hk, d, generator=g).to(dtype).to(DEVICE)
        tables = torch.full((len(ctx_lens), max(need) + 2), bad, dtype=torch.int32)
        perm, used = torch.randperm(nb, generator=g), 0
        for b, n in enumerate(need):
            tables[b, :n] = perm[used : used + n]
            used += n
        q_lens_t = torch.tensor(q_lens)
        cu = torch.nn.functional.pad(q_lens_t.cumsum(0), (1, 0)).to(torch.int32)
        q = torch.randn(int(q_lens_t.sum()), hq, d, generator=g).to(dtype).to(DEVICE)
        lens = torch.tensor(ctx_lens, dtype=torch.int32)
        return q, kc, vc, tables.to(DEVICE), lens.to(DEVICE), cu.to(DEVICE), q_lens_t


    def close(got, want, dtype, what):
        err = (got.float() - want).abs().max().item() if got.numel() else 0.0
        assert err <= TOL[dtype], (what, err)


    def check_decode(hq, hk, d, dtype, ctx_lens, splits):
        q, kc, vc, tables, lens, cu, _ = batch(ctx_lens, [1] * len(ctx_lens), hq, hk, d, dtype)
        got = paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, splits)
        close(got, ref(q, kc, vc, tables, lens, cu, d**-0.5), dtype, (hq, hk, d, splits))
        assert not got[lens == 0].any()  # padding rows: zeros


    def check_prefill(hq, hk, d, dtype, ctx_lens, q_lens):
        q, kc, vc, tables, lens, cu, q_lens_t = batch(ctx_lens, q_lens, hq, hk, d, dtype)
        got = paged_prefill_attention(q, kc, vc, tables, lens, cu, max(q_lens), d**-0.5)
        close(got, ref(q, kc, vc, tables, lens, cu, d**-0.5), dtype, (hq, hk, d, q_lens))


    def check_store_kv(dtype):
        kc = torch.zeros(6, 4, 2, 16, dtype=dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        kv = torch.randn(7, 2, 2, 2, 16, generator=g).to(dtype).to(DEVICE)  # strided k and v
        slots = torch.tensor([5, -1, 0, 23, -1, 12, 7], device=DEVICE)
        store_kv(kv[:, 0, 0], kv[:, 1, 1], kc, vc, slots)
        want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
        ok = slots >= 0
        want_k.view(-1, 2, 16)[slots[ok]] = kv[ok, 0, 0]
        want_v.view(-1, 2, 16)[slots[ok]] = kv[ok, 1, 1]
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


    def run_module(layer, q, k, v, ctx, kernels, rotary):
        attention._paged_kernels = lambda x: kernels
        attention.prepare_attention(ctx, layer.k_cache.size(1))
        set_context(ctx)
        return layer(q, k, v, *rotary)


    def check_module(dtype, ctx_lens, q_lens, rotary):
        # Attention.forward through the kernels vs its SDPA path, cache writes included; with
        # the rotary, fused with the cache write on the kernel path.
        q, kc, vc, tables, lens, cu, q_lens_t = batch(ctx_lens, q_lens, 4, 2, 16, dtype, bad=0)
        k = torch.randn(q.size(0), 2, 16, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(q.size(0), 2, 16, generator=g).to(dtype).to(DEVICE)
        pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx_lens, q_lens)]).to(DEVICE)
        seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t).to(DEVICE)
        slots = tables[seq, pos // 16].long() * 16 + pos % 16
        ctx = AttentionContext(slots, tables.long(), lens.long(), q_lens_t.to(DEVICE),
                               cu.long(), max(q_lens))
        rope = RotaryEmbedding(types.SimpleNamespace(rope_theta=10000.0), 16, 256).to(DEVICE)
        rotary = (pos, rope) if rotary else ()
        outs, caches = [], []
        for kernels in (False, True):
            layer = attention.Attention(4, 16, 0.25, 2)
            layer.k_cache, layer.v_cache = kc.clone(), vc.clone()
            step = AttentionContext(**vars(ctx))
            outs.append(run_module(layer, q, k, v, step, kernels, rotary))
            caches.append((layer.k_cache, layer.v_cache))
        attention._paged_kernels = lambda x: x.is_cuda
        close(outs[1], outs[0].float(), dtype, ("module", q_lens))
        assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1])), (dtype, rotary)


    cases = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        check_store_kv(dtype)
        # Tiny test Llama (GQA 2), SmolLM2 (GQA 3, not a power of two), MHA at head_dim 128.
        for hq, hk, d in ((4, 2, 16), (9, 3, 64), (2, 2, 128)):
            for splits in (1, 4):
                check_decode(hq, hk, d, dtype, [0, 1, 16, 37, 64, 5, 0, 150], splits)
                cases += 1
            check_prefill(hq, hk, d, dtype, [33, 16, 70], [33, 16, 70])  # whole prompts
            check_prefill(hq, hk, d, dtype, [80, 40, 17, 0, 3], [20, 1, 17, 0, 2])  # mixed
            cases += 2
        for rotary in (False, True):
            check_module(dtype, [80, 40, 17], [20, 1, 17], rotary)
            check_module(dtype, [9, 32, 1], [1, 1, 1], rotary)
            cases += 2
    print("cases", cases)
    """
)


def test_reference_matches_cpu_attention() -> None:
    """The oracle agrees with the CPU SDPA path on a mixed step (prefill chunk, decode, whole
    prompt) whose blocks are not contiguous."""
    g = torch.Generator().manual_seed(1)
    ctx_lens, q_lens = [40, 9, 16], [8, 1, 16]
    kc, vc = torch.randn(2, 10, 16, 2, 32, generator=g)
    tables = torch.tensor([[7, 2, 9], [4, 0, 0], [1, 0, 0]])
    q_lens_t = torch.tensor(q_lens)
    cu = torch.nn.functional.pad(q_lens_t.cumsum(0), (1, 0))
    pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx_lens, q_lens, strict=True)])
    seq = torch.repeat_interleave(torch.arange(3), q_lens_t)
    slots = tables[seq, pos // 16] * 16 + pos % 16
    ctx = AttentionContext(slots, tables, torch.tensor(ctx_lens), q_lens_t, cu, max(q_lens))
    attention.prepare_attention(ctx, 16)
    set_context(ctx)
    layer = attention.Attention(8, 32, 0.2, 2)
    layer.k_cache, layer.v_cache = kc, vc
    q, k, v = (torch.randn(25, h, 32, generator=g) for h in (8, 2, 2))
    out = layer(q, k, v).view(25, 8, 32)
    torch.testing.assert_close(
        out, paged_attention_reference(q, kc, vc, tables, ctx.context_lens, cu, 0.2)
    )


def test_kernels_match_reference_interpreted() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(CHECK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cases 48" in result.stdout


@pytest.mark.gpu
def test_kernels_match_reference_cuda() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    exec("DEVICE = 'cuda'\n" + CHECK, {})


LARGE = textwrap.dedent(
    """
    # Llama-3.2-1B shapes, contexts up to 2048, the split count the GPU picks.
    for b, top in ((1, 2048), (3, 1500), (64, 2048), (300, 700)):
        lens = torch.randint(1, top + 1, (b,), generator=g).tolist()
        lens[0] = top
        check_decode(32, 8, 64, torch.bfloat16, lens, None)
    check_prefill(32, 8, 64, torch.bfloat16, [1000, 2048, 300, 77], [1000, 513, 1, 77])
    check_prefill(16, 8, 128, torch.float16, [600, 70], [600, 69])
    check_prefill(24, 8, 128, torch.float32, [600, 64], [100, 64])
    """
)


@pytest.mark.gpu
def test_kernels_large_cuda() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    exec("DEVICE = 'cuda'\n" + CHECK.split("cases = 0")[0] + LARGE, {})


def _decode_step(bufs: dict, ctx_lens: list[int], g: torch.Generator) -> None:
    """Fill a padded decode step in place: rows past `ctx_lens` are padding (context 0, table
    row of zeros, slot -1); real rows get random distinct blocks and a new token."""
    page, hk, d = bufs["k_cache"].shape[1:]
    free = torch.randperm(bufs["k_cache"].size(0), generator=g).tolist()
    bufs["tables"].zero_()
    bufs["lens"].zero_()
    bufs["slots"].fill_(-1)
    for b, n in enumerate(ctx_lens):
        blocks = [free.pop() for _ in range(-(-n // page))]
        bufs["tables"][b, : len(blocks)] = torch.tensor(blocks)
        bufs["lens"][b] = n
        bufs["slots"][b] = blocks[-1] * page + (n - 1) % page
    for name in ("q", "k", "v"):
        bufs[name].copy_(torch.randn(bufs[name].shape, generator=g))


@pytest.mark.gpu
def test_decode_cuda_graph_with_padding() -> None:
    """KV write + decode captured once in a CUDA graph at a padded batch, then replayed with
    other lengths, tables and batch sizes: real rows match the reference, padding rows are zeros
    and write nothing to the cache."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from atom.model_ops.paged_attention import paged_decode_attention, store_kv

    g = torch.Generator().manual_seed(2)
    batch, hq, hk, d, page, width = 8, 32, 8, 64, 16, 64
    dev, dt = "cuda", torch.bfloat16
    bufs = {
        "k_cache": torch.randn(600, page, hk, d, generator=g).to(dev, dt),
        "v_cache": torch.randn(600, page, hk, d, generator=g).to(dev, dt),
        "q": torch.empty(batch, hq, d, device=dev, dtype=dt),
        "k": torch.empty(batch, hk, d, device=dev, dtype=dt),
        "v": torch.empty(batch, hk, d, device=dev, dtype=dt),
        "tables": torch.zeros(batch, width, dtype=torch.int32, device=dev),
        "lens": torch.zeros(batch, dtype=torch.int32, device=dev),
        "slots": torch.full((batch,), -1, dtype=torch.int64, device=dev),
    }

    def step() -> torch.Tensor:
        kc, vc = bufs["k_cache"], bufs["v_cache"]
        store_kv(bufs["k"], bufs["v"], kc, vc, bufs["slots"])
        return paged_decode_attention(bufs["q"], kc, vc, bufs["tables"], bufs["lens"], d**-0.5)

    _decode_step(bufs, [5] * batch, g)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for ctx_lens in ([1000, 16, 1, 1024], [3] * batch, [width * page, 17, 33]):
        _decode_step(bufs, ctx_lens, g)
        before_k, before_v = bufs["k_cache"].clone(), bufs["v_cache"].clone()
        graph.replay()
        torch.cuda.synchronize()
        n = len(ctx_lens)
        for cache, before, new in (
            (bufs["k_cache"], before_k, "k"),
            (bufs["v_cache"], before_v, "v"),
        ):
            before.view(-1, hk, d)[bufs["slots"][:n]] = bufs[new][:n]
            assert torch.equal(cache, before)  # real rows written, padding rows not
        cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        want = paged_attention_reference(
            bufs["q"], bufs["k_cache"], bufs["v_cache"], bufs["tables"], bufs["lens"], cu, d**-0.5
        )
        assert (out[:n].float() - want[:n]).abs().max().item() <= 3e-2
        assert not out[n:].any()
