"""Mask buffers and token snapshots."""

from __future__ import annotations

import pytest
import torch

from atom.model_ops.triton_structured_output import (
    apply_token_bitmask_inplace_reference,
)
from atom.structured_output.utils import (
    MaskBuffers,
    TokenSnapshot,
    num_mask_words,
)


def test_buffers_grow_and_reuse() -> None:
    bufs = MaskBuffers(1000)
    assert bufs.capacity == 0 and bufs.num_words == num_mask_words(1000) == 32
    rows = bufs.host_rows(3)
    assert rows.shape == (3, 32) and bufs.capacity == 8
    assert bufs.host_rows(5).data_ptr() == rows.data_ptr()  # reused, no reallocation
    bufs.host_rows(20)
    assert bufs.capacity == 20


def test_apply_matches_reference_with_row_indices() -> None:
    bufs = MaskBuffers(100)
    rows = bufs.host_rows(2)
    rows.copy_(torch.randint(-(2**31), 2**31 - 1, (2, 4), dtype=torch.int32))
    logits = torch.randn(4, 130)  # LM head wider than the mask: tail forbidden
    want = logits.clone()
    apply_token_bitmask_inplace_reference(want, rows.clone(), torch.tensor([3, 1]))
    bufs.apply(logits, 2, [3, 1])
    assert torch.equal(logits, want)
    with pytest.raises(ValueError):
        bufs.apply(logits, 2, [0])


def test_snapshot_owns_its_copy() -> None:
    src = torch.tensor([5, 6, 7])
    snap = TokenSnapshot(src)
    src.fill_(0)
    assert snap.ready() and snap.tolist() == [5, 6, 7]


@pytest.mark.gpu
def test_cuda_path_with_stream_change() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bufs = MaskBuffers(4099, "cuda")
    side = torch.cuda.Stream()
    for step in range(6):
        n = (1, 4, 9)[step % 3]
        rows = bufs.host_rows(n)
        rows.copy_(torch.randint(-(2**31), 2**31 - 1, rows.shape, dtype=torch.int32))
        src = rows.clone()
        logits = torch.randn(n + 1, 4099, device="cuda")
        want = logits.cpu()
        apply_token_bitmask_inplace_reference(want, src, torch.arange(1, n + 1, dtype=torch.int32))
        stream = side if step % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            bufs.apply(logits, n, list(range(1, n + 1)))
            snap = TokenSnapshot(logits.argmax(-1))
        assert snap.tolist() == want.argmax(-1).tolist()
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(logits.cpu(), want)
