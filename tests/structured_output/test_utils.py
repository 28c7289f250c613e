"""Mask buffers, llguidance row filling (single, parallel, drafts) and token snapshots."""

from __future__ import annotations

import pytest
import torch

llguidance = pytest.importorskip("llguidance")

from atom.model_ops.triton_structured_output import (  # noqa: E402
    apply_token_bitmask_inplace_reference,
)
from atom.structured_output.utils import (  # noqa: E402
    MaskBuffers,
    TokenSnapshot,
    fill_bitmask_row,
    fill_bitmask_rows_par,
    fill_bitmask_rows_with_drafts,
    num_mask_words,
)

EOS = 256


class ByteTokenizer:
    """A TokenizerWrapper-shaped toy: one token per byte plus EOS (cheap to build)."""

    is_tokenizer_wrapper = True
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def grammar_matcher():
    tok = llguidance.LLTokenizer(ByteTokenizer())
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    return lambda: llguidance.LLMatcher(tok, grammar, log_level=0)


def allowed(row: torch.Tensor) -> set[int]:
    bits = (row.view(-1, 1).to(torch.int64) >> torch.arange(32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


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


def test_fill_single_parallel_and_drafts(grammar_matcher) -> None:
    m = grammar_matcher()
    mask = torch.zeros(4, num_mask_words(257), dtype=torch.int32)
    fill_bitmask_row(m, mask, 1)
    assert allowed(mask[1]) == {ord("{")}

    matchers = [grammar_matcher(), grammar_matcher()]
    assert matchers[1].consume_tokens(list(b'{"a":1'))
    fill_bitmask_rows_par(llguidance.LLExecutor(2), [(matchers[0], 0), (matchers[1], 3)], mask)
    assert allowed(mask[0]) == {ord("{")}
    assert {ord("}"), ord("2")} <= allowed(mask[3]) and ord("{") not in allowed(mask[3])

    drafts = list(b'{"a"')
    mask = torch.zeros(len(drafts) + 1, num_mask_words(257), dtype=torch.int32)
    m = grammar_matcher()
    fill_bitmask_rows_with_drafts(llguidance.LLExecutor(1), [(m, 0, drafts)], mask)
    assert allowed(mask[0]) == {ord("{")}
    assert allowed(mask[1]) >= {ord('"')} and allowed(mask[4]) >= {ord(":")}
    fill_bitmask_row(m, mask, 0)  # the drafts were rolled back
    assert allowed(mask[0]) == {ord("{")}


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
