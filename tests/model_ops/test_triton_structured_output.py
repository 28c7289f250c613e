"""Packed-bitmask kernel vs the CPU reference: interpreted on CPU (CI) and on a real GPU."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

from atom.model_ops.triton_structured_output import apply_token_bitmask_inplace_reference

NEG = float("-inf")


def pack(bits: torch.Tensor) -> torch.Tensor:
    """[R, 32 * W] bool -> int32 [R, W] (bit j of word w is token 32 w + j)."""
    rows, n = bits.shape
    words = (bits.view(rows, n // 32, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return words.to(torch.int32)


def test_reference_semantics() -> None:
    bits = torch.zeros(2, 64, dtype=torch.bool)
    bits[0, [0, 5, 31, 40]] = True
    bits[1, [1, 63]] = True
    mask = pack(bits)
    logits = torch.arange(3 * 70, dtype=torch.float32).view(3, 70) + 1
    out = logits.clone()
    apply_token_bitmask_inplace_reference(out, mask, torch.tensor([2, 0]))
    assert torch.equal(out[1], logits[1])  # untouched row
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0, 5, 31, 40]
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 63]  # 64.. is the tail
    assert out[2, 5] == logits[2, 5]

    narrow = logits[:2, :20].clone()  # a mask wider than the logits
    apply_token_bitmask_inplace_reference(narrow, mask)
    assert torch.isfinite(narrow[0]).nonzero().flatten().tolist() == [0, 5]


def test_reference_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace_reference(
            torch.zeros(2, 40), torch.zeros(1, 2, dtype=torch.int32)
        )
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace_reference(torch.zeros(1, 40), torch.zeros(1, 2))


CHECK = textwrap.dedent(
    """
    import torch
    from atom.model_ops.triton_structured_output import (
        apply_token_bitmask_inplace_reference as ref,
        apply_token_bitmask_inplace_triton as kernel,
    )
    device = "{device}"
    g = torch.Generator().manual_seed(0)
    # (words per sub-tile, sub-tiles, tiles, warps, wide, sparse_k, eager, max_regs): dense only, sparse
    # with one to three tokens per word, several sub-tiles and tiles per program, both mask
    # loads, logits loaded after or beside the mask.
    configs = [
        None, (8, 1, 1, 2, False, 0), (32, 1, 4, 4, False, 0), (4, 2, 3, 1, True, 1),
        (16, 2, 3, 2, True, 3), (8, 4, 2, 2, False, 2), (16, 1, 2, 2, True, 0, True),
        (8, 2, 1, 2, False, 2, True, 56),
    ]
    cases = 0
    for vocab, words in ((1, 1), (33, 2), (257, 9), (1000, 30), (4099, 129), (8200, 257)):
        for rows in (None, [3, 0], [5]):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                share = torch.rand((), generator=g).item()
                bits = torch.rand(6, 32 * words, generator=g) < share
                bits[0, : 32 * min(20, words)] = True  # uniform steps: all-ones, all-zero
                bits[1, : 32 * min(20, words)] = False
                bits[2:4] = torch.rand(2, 32 * words, generator=g) < 0.999  # sparse tiles
                bits[3, 70:75] = False  # one word over every sparse_k: that tile goes dense
                mask = (bits.view(6, words, 32).long() << torch.arange(32)).sum(-1).int()
                logits = (torch.randn(6, vocab, generator=g) + 3).to(dtype)
                want = logits.clone()
                idx = None if rows is None else torch.tensor(rows, dtype=torch.int32)
                ref(want, mask, idx)
                for config in configs if vocab in (4099, 8200) else [None]:
                    got = logits.to(device)
                    kernel(got, mask.to(device), None if idx is None else idx.to(device),
                           config=config)
                    assert torch.equal(got.cpu(), want), (vocab, words, rows, dtype, config)
                    cases += 1
                # A stamp: its value masks as before; another one masks nothing, even with a
                # row index out of range (a stale area's).
                stamp = torch.tensor([7], dtype=torch.int32)
                got = logits.to(device)
                kernel(got, mask.to(device), None if idx is None else idx.to(device),
                       (stamp.to(device), 7))
                assert torch.equal(got.cpu(), want), ("stamp", vocab, words, rows, dtype)
                stale = None if idx is None else torch.full_like(idx, 10**6)
                got, kept = logits.to(device), logits.clone()
                kernel(got, mask.to(device), None if stale is None else stale.to(device),
                       (stamp.to(device), 8))
                ref(kept, mask, stale, (stamp, 8))
                assert torch.equal(got.cpu(), logits) and torch.equal(kept, logits)
                cases += 2
    print("cases", cases)
    """
)


def test_kernel_matches_reference_interpreted() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(CHECK.format(device="cpu"), timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cases 288" in result.stdout


@pytest.mark.gpu
def test_kernel_matches_reference_cuda() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    exec(CHECK.format(device="cuda"), {})
