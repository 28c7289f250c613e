"""The Triton argmax (``triton_argmax``) gives ``torch.argmax``'s answer: first maximum, NaN
above everything, a row of -inf at 0; under the interpreter on CPU and on CUDA."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from atom.model_ops.triton_argmax import CHUNK, argmax_rows_triton

    g = torch.Generator().manual_seed(0)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, vocab in ((1, 129280), (4, 4096), (5, 2 * CHUNK + 1), (4, 7)):
            x = torch.randn(rows, vocab, generator=g).to(dtype)
            if rows >= 4:
                x[1] = float("-inf")  # every token forbidden
                x[2, vocab // 3] = x[2, vocab - 1] = 100.0  # a tie: the first wins
                x[3, vocab // 2] = x[3, vocab - 1] = float("nan")  # the first NaN, over +inf
                x[3, 0] = float("inf")
            x = x.to(DEVICE)
            want = x.argmax(dim=-1)
            got = argmax_rows_triton(x)
            assert got.dtype == torch.int64 and torch.equal(got, want), (dtype, rows, vocab)
            strided = torch.cat([x, x], dim=1)[:, :vocab]  # rows with a stride past the vocab
            assert torch.equal(argmax_rows_triton(strided), want)
            cases += 1
    print("cases", cases)
    """
)


def test_argmax_matches_torch_interpreted() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(CHECK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cases 12" in result.stdout


def test_sampler_argmax_on_cpu_is_torch_and_loads_no_triton() -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        from atom.model_ops.sampler import argmax_rows

        x = torch.randn(3, 50)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        assert "triton" not in sys.modules
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
def test_argmax_matches_torch_cuda() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    exec("DEVICE = 'cuda'\n" + CHECK, {})


@pytest.mark.gpu
def test_argmax_in_cuda_graph() -> None:
    """Captured once, replayed on new logits written into the same buffer."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from atom.model_ops.triton_argmax import argmax_rows_triton

    logits = torch.randn(8, 129280, device="cuda", dtype=torch.bfloat16)
    argmax_rows_triton(logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows_triton(logits)
    for seed in range(3):
        logits.copy_(torch.randn(8, 129280, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, logits.argmax(dim=-1))
