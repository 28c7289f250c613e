"""Fused Triton kernels (RMSNorm + residual, rotary, SiLU-and-mul) vs the PyTorch code of the
modules they replace: interpreted on CPU (CI) and on a real GPU.

The reference is each module's own PyTorch path, run on the same device with the kernel switch
off, so the kernels are held to exactly what ran before them. 16-bit results may differ from it
by an ulp or two, and only rarely (the order of an fp32 sum, GPU `rsqrt`/`exp`); rotary, and the
residual sum, must be bit-identical.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

# Shared by the interpreted and the CUDA checks; DEVICE is defined before it runs.
CHECK = textwrap.dedent(
    """
    import types

    import torch

    from atom.model_ops import activation, layernorm, rotary_embedding
    from atom.model_ops.activation import SiluAndMul
    from atom.model_ops.layernorm import RMSNorm
    from atom.model_ops.rotary_embedding import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    SWITCHES = (activation, layernorm, rotary_embedding)
    DTYPES = (torch.float32, torch.bfloat16, torch.float16)


    def rand(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


    def both(fn):
        # fn() through the PyTorch code, then through the kernels (inputs must stay unchanged).
        outs = []
        for kernels in (False, True):
            for module in SWITCHES:
                module._use_kernels = lambda x, k=kernels: k
            outs.append(fn())
        for module in SWITCHES:
            module._use_kernels = lambda x: x.is_cuda
        return outs


    def close(got, want, what, exact=False):
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
        if exact or want.dtype == torch.float32:
            rtol, atol = (0.0, 0.0) if exact else (1e-5, 1e-6)
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=str(what))
            return
        # A rare one-ulp flip of an intermediate rounding (at most eps * |value|) becomes at most
        # two ulps of the result after the product that follows it.
        eps = torch.finfo(want.dtype).eps
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=1e-6, msg=str(what))
        mismatched = (got != want).float().mean().item()
        assert mismatched <= 0.01, (what, mismatched)


    def check_norm(tokens, dim, dtype, residual, eps=1e-6, w_dtype=None):
        # x is a column slice (rows strided); weight is not ones, so its product shows.
        norm = RMSNorm(dim, eps).to(DEVICE)
        norm.weight.data = rand(dim, dtype=w_dtype or dtype) + 1
        x = rand(tokens, dim + 5, dtype=dtype, scale=3)[:, :dim]
        res = rand(tokens, dim, dtype=dtype) if residual else None
        before = (x.clone(), None if res is None else res.clone())
        want, got = both(lambda: norm(x) if res is None else norm(x, res))
        what = ("norm", tokens, dim, dtype, residual, w_dtype)
        if res is None:
            close(got, want, what)
        else:
            close(got[0], want[0], what)
            close(got[1], want[1], what, exact=True)  # the rounded residual sum
            assert torch.equal(res, before[1])
        assert torch.equal(x, before[0])


    def check_head_norm(tokens, heads, dim, dtype, residual):
        # Qwen3's per-head q norm: [T, H, D] views of a qkv row, normalized over D.
        norm = RMSNorm(dim, 1e-6).to(DEVICE)
        norm.weight.data = rand(dim, dtype=dtype) + 1
        qkv = rand(tokens, (heads + 4) * dim, dtype=dtype)
        q = qkv[:, dim : (heads + 1) * dim].view(tokens, heads, dim)
        res = rand(tokens, heads, dim, dtype=dtype) if residual else None
        before = qkv.clone()
        want, got = both(lambda: norm(q) if res is None else norm(q, res))
        what = ("head norm", tokens, heads, dim, dtype, residual)
        if res is None:
            close(got, want, what)
        else:
            close(got[0], want[0], what)
            close(got[1], want[1], what, exact=True)
        assert torch.equal(qkv, before)


    def check_rotary(tokens, hq, hk, d, dtype, views):
        # q/k as the model passes them: strided views of one qkv row, or contiguous tensors
        # (after Qwen3's q/k norm). Positions are arbitrary, the last cache row included.
        rope = RotaryEmbedding(types.SimpleNamespace(rope_theta=10000.0), d, 300).to(DEVICE)
        qkv = rand(tokens, (hq + 2 * hk) * d, dtype=dtype, scale=2)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
        if not views:
            q, k = q.contiguous(), k.contiguous()
        positions = torch.randint(0, 300, (tokens,), generator=g)
        positions[-1] = 299
        positions = positions.to(DEVICE)
        before = qkv.clone()
        want, got = both(lambda: rope(positions, q, k))
        for w, o in zip(want, got):
            close(o, w, ("rotary", tokens, hq, hk, d, dtype, views), exact=True)
        assert torch.equal(qkv, before)


    def check_rotary_store_kv(tokens, hq, hk, d, dtype):
        # Rotary fused with the paged cache write: q as the PyTorch rotary gives it, the cache
        # rows at the tokens' slots hold its rotated k and v, a slot of -1 writes nothing.
        from atom.model_ops.fused_kernels import rotary_embedding_store_kv

        rope = RotaryEmbedding(types.SimpleNamespace(rope_theta=10000.0), d, 300).to(DEVICE)
        qkv = rand(tokens, (hq + 2 * hk) * d, dtype=dtype, scale=2)
        q, k, v = (x.view(tokens, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=1))
        positions = torch.randint(0, 300, (tokens,), generator=g).to(DEVICE)
        slots = torch.randperm(8 * 8, generator=g)[:tokens]
        slots[0] = -1
        k_cache = torch.full((8, 8, hk, d), 7.0, dtype=dtype, device=DEVICE)
        v_cache = torch.full_like(k_cache, 7.0)
        rotary_embedding._use_kernels = lambda x: False
        want_q, want_k = rope(positions, q, k)
        rotary_embedding._use_kernels = lambda x: x.is_cuda
        got_q = rotary_embedding_store_kv(
            positions, q, k, v, rope.cos_sin_cache, k_cache, v_cache, slots.to(DEVICE)
        )
        what = ("rotary store", tokens, hq, hk, d, dtype)
        close(got_q, want_q, what, exact=True)
        written = slots >= 0
        flat_k, flat_v = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)
        close(flat_k[slots[written]], want_k[written.to(DEVICE)], what, exact=True)
        close(flat_v[slots[written]], v[written.to(DEVICE)], what, exact=True)
        untouched = torch.ones(flat_k.size(0), dtype=torch.bool)
        untouched[slots[written]] = False
        assert bool((flat_k[untouched] == 7).all()) and bool((flat_v[untouched] == 7).all())


    def check_silu(tokens, width, dtype):
        # The merged gate/up output; a column slice so that rows are strided.
        x = rand(tokens, 2 * width + 3, dtype=dtype, scale=3)[:, : 2 * width]
        before = x.clone()
        want, got = both(lambda: SiluAndMul()(x))
        close(got, want, ("silu", tokens, width, dtype))
        assert torch.equal(x, before)


    cases = 0
    for dtype in DTYPES:
        for tokens in (1, 37):
            for dim in (64, 37, 2100):
                for residual in (False, True):
                    check_norm(tokens, dim, dtype, residual)
                    cases += 1
            for heads, dim in ((5, 16), (3, 128)):
                check_head_norm(tokens, heads, dim, dtype, residual=False)
                check_head_norm(tokens, heads, dim, dtype, residual=True)
                cases += 2
            # Tiny test Llama, SmolLM2 (GQA 3), Llama-3.2-1B, a half that is not a power of 2.
            for hq, hk, d in ((4, 2, 16), (9, 3, 64), (32, 8, 64), (5, 1, 6)):
                for views in (True, False):
                    check_rotary(tokens, hq, hk, d, dtype, views)
                    cases += 1
                check_rotary_store_kv(tokens, hq, hk, d, dtype)
                cases += 1
            for width in (1, 100, 1500):
                check_silu(tokens, width, dtype)
                cases += 1
        check_norm(3, 40, dtype, True, eps=0.5)  # eps that matters
        check_norm(3, 40, dtype, True, w_dtype=torch.float32)  # promoted output
        cases += 2
    print("cases", cases)
    """
)

# A tiny Llama and a tiny Qwen3 (per-head q/k norm) prefill two sequences, once through the
# PyTorch ops and once through the kernels; attention is the same in both runs.
MODEL = textwrap.dedent(
    """
    from atom.model_ops import attention
    from atom.model_ops.context import AttentionContext, set_context
    from atom.models.llama import LlamaForCausalLM


    def tiny(model_type):
        return types.SimpleNamespace(
            model_type=model_type, vocab_size=300, hidden_size=80, intermediate_size=150,
            num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, head_dim=16,
            hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=64,
            rope_theta=10000.0, tie_word_embeddings=False,
        )


    def check_model(model_type, dtype):
        model = LlamaForCausalLM(tiny(model_type)).to(DEVICE)
        for name, p in model.named_parameters():
            p.data = rand(*p.shape, dtype=dtype, scale=0.3) + (1.0 if "norm" in name else 0.0)
        for layer in model.model.layers:
            attn = layer.self_attn.attn
            attn.k_cache = torch.zeros(4, 16, 1, 16, dtype=dtype, device=DEVICE)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        lens = torch.tensor([7, 4])
        ctx = AttentionContext(
            torch.tensor([*range(7), *range(16, 20)]).to(DEVICE),
            torch.tensor([[0], [1]]).to(DEVICE), lens.to(DEVICE), lens.to(DEVICE),
            torch.tensor([0, 7, 11]).to(DEVICE), 7,
        )
        attention.prepare_attention(ctx, 16)
        set_context(ctx)
        ids = torch.randint(0, 300, (11,), generator=g).to(DEVICE)
        positions = torch.tensor([*range(7), *range(4)]).to(DEVICE)
        with torch.inference_mode():
            want, got = both(lambda: model(ids, positions))
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=str((model_type, dtype)))


    for model_type in ("llama", "qwen3"):
        for dtype in (torch.float32, torch.bfloat16):
            check_model(model_type, dtype)
            cases += 1
    print("model cases", cases)
    """
)


def test_kernels_match_reference_interpreted() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(CHECK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cases 156" in result.stdout


def test_model_matches_reference_interpreted() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(CHECK.split("cases = 0")[0] + "cases = 0\n" + MODEL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model cases 4" in result.stdout


def test_cpu_path_never_imports_triton() -> None:
    """The modules' CPU path (what CI and CPU serving run) stays plain PyTorch."""
    code = CHECK.split("def both")[0] + textwrap.dedent(
        """
        import sys

        RMSNorm(8).to(DEVICE)(rand(3, 8), rand(3, 8))
        SiluAndMul()(rand(3, 8))
        rope = RotaryEmbedding(types.SimpleNamespace(rope_theta=10000.0), 8, 16)
        rope(torch.arange(3), rand(3, 2, 8), rand(3, 1, 8))
        assert "triton" not in sys.modules
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", "DEVICE = 'cpu'\n" + code], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
def test_kernels_match_reference_cuda() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    exec("DEVICE = 'cuda'\n" + CHECK + MODEL, {})


@pytest.mark.gpu
def test_kernels_cuda_graph() -> None:
    """Norm, rotary and SiLU-and-mul captured once in a CUDA graph, then replayed on new inputs
    written into the same buffers: the outputs follow the inputs."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from atom.model_ops import fused_kernels as fk

    g = torch.Generator().manual_seed(3)
    dev, dt, t, hidden, hq, hk, d = "cuda", torch.bfloat16, 4, 2048, 32, 8, 64
    width = (hq + 2 * hk) * d
    bufs = {
        "x": torch.empty(t, hidden, device=dev, dtype=dt),
        "res": torch.empty(t, hidden, device=dev, dtype=dt),
        "qkv": torch.empty(t, width, device=dev, dtype=dt),
        "gate_up": torch.empty(t, 2 * 8192, device=dev, dtype=dt),
        "pos": torch.zeros(t, dtype=torch.long, device=dev),
    }
    weight = torch.randn(hidden, generator=g).to(dev, dt)
    cache = torch.randn(2048, d, generator=g).to(dev)

    def step() -> tuple[torch.Tensor, ...]:
        q = bufs["qkv"][:, : hq * d].view(t, hq, d)
        k = bufs["qkv"][:, hq * d : (hq + hk) * d].view(t, hk, d)
        normed, summed = fk.fused_add_rms_norm(bufs["x"], bufs["res"], weight, 1e-5)
        return (normed, summed, *fk.rotary_embedding(bufs["pos"], q, k, cache),
                fk.silu_and_mul(bufs["gate_up"]))  # fmt: skip

    def fill() -> None:
        for name in ("x", "res", "qkv", "gate_up"):
            bufs[name].copy_(torch.randn(bufs[name].shape, generator=g))
        bufs["pos"].copy_(torch.randint(0, 2048, (t,), generator=g))

    fill()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, step(), strict=True):
            assert torch.equal(got, want)
