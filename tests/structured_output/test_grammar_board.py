"""The board a rank shares with its grammar process (``grammar_board``): two mappings of one
file see each other's counters and rows, counters only grow, and a wait ends with a timeout
when the value never comes or the writer is gone (a stream never waits on a dead child)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from atom.config import EngineConfig
from atom.structured_output.grammar_board import (
    COPIED,
    DONE,
    RELEASED,
    TOKENS,
    GrammarBoard,
    GrammarBoardTimeout,
)


@pytest.fixture
def boards():
    rank = GrammarBoard.create(max_rows=8, num_words=5)
    child = GrammarBoard(rank.path, 8, 5)
    rank.unlink()
    return rank, child


def test_two_mappings_share_counters_rows_and_ring(boards):
    rank, child = boards
    assert [rank.get(f) for f in (TOKENS, DONE, COPIED)] == [0, 0, 0]
    child.rows(3)[2] = 7
    child.row_index(3)[:2] = 4
    rank.tokens(6)[1] = 2**40  # int64 ids, as the sampler gives them
    assert int(rank.rows(1)[2, 0]) == 7 and int(rank.rows(2)[2, 0]) == 0  # gate 3: area 1
    assert rank.row_index(5)[:2].tolist() == [4, 4] and rank.row_index(4)[:2].tolist() == [0, 0]
    assert int(child.tokens(2)[1]) == 2**40  # gate 6 and gate 2 share a ring slot of 4
    child.set(DONE, 5)
    child.set(DONE, 3)  # never lowered
    assert rank.get(DONE) == 5
    assert rank.address(DONE) - rank.address(TOKENS) == 8


def test_an_area_is_one_run_of_row_index_stamp_then_rows(boards):
    """What a step copies to the device: the row index and the stamp, then its first n rows."""
    rank, child = boards
    child.row_index(7)[:3] = torch.tensor([5, 0, 2], dtype=torch.int32)
    child.row_index(7)[-1] = 7  # the stamp, after the 8 rows' indices
    child.rows(7)[:3] = torch.arange(15, dtype=torch.int32).view(3, 5)
    area = rank.area(7, 3)
    assert area.numel() == rank.index_words + 3 * 5 and rank.index_words >= 9
    assert area[:3].tolist() == [5, 0, 2] and int(area[8]) == 7
    assert int(rank.row_index(6)[8]) == 0  # the other area's stamp
    assert area[rank.index_words :].view(3, 5).equal(child.rows(1)[:3])


def test_a_wait_ends_when_the_counter_arrives(boards):
    rank, child = boards
    threading.Timer(0.05, child.set, (TOKENS, 2)).start()
    start = time.perf_counter()
    rank.wait(TOKENS, 2, timeout_s=5)
    assert 0.04 < time.perf_counter() - start < 2


def test_a_wait_ends_on_timeout_or_a_dead_writer(boards):
    rank, _ = boards
    with pytest.raises(GrammarBoardTimeout):
        rank.wait(DONE, 1, timeout_s=0.05)
    start = time.perf_counter()
    with pytest.raises(GrammarBoardTimeout):
        rank.wait(DONE, 1, timeout_s=60, alive=lambda: False)
    assert time.perf_counter() - start < 1
    rank.set(DONE, RELEASED)
    rank.wait(DONE, 10**9, timeout_s=0)  # released: every gate passes


def test_grammar_process_default_follows_the_device():
    assert EngineConfig().grammar_process("cuda") is True
    assert EngineConfig().grammar_process("cpu") is False
    assert EngineConfig(structured_output_grammar_process=False).grammar_process("cuda") is False
    assert EngineConfig(structured_output_grammar_process=True).grammar_process("cpu") is True


def test_grammar_processes_split_the_cores_but_the_engine_threads(monkeypatch):
    """On 4 cores or more the children share all cores but the last (the engine thread's), one
    contiguous share each, and run at most one llguidance thread per core; on fewer (this CI
    machine has 2) they are not pinned."""
    from atom.structured_output import grammar_process

    placed: list[list[int]] = []
    monkeypatch.setattr(grammar_process.os, "sched_setaffinity", lambda _, c: placed.append(c))
    monkeypatch.setattr(grammar_process.os, "sched_getaffinity", lambda _: set(range(16)))
    assert grammar_process.split_cores(1) == [list(range(15))]
    assert grammar_process.split_cores(2) == [list(range(7)), list(range(7, 15))]
    assert grammar_process._pin({"threads": 16, "vocab_size": 9}, list(range(7))) == {
        "threads": 7,
        "vocab_size": 9,
    }
    assert placed == [list(range(7))]
    monkeypatch.setattr(grammar_process.os, "sched_getaffinity", lambda _: {0, 1})
    assert grammar_process.split_cores(2) == [None, None]
    assert grammar_process._pin({"threads": 2}, None) == {"threads": 2}
    assert len(placed) == 1


def test_grammar_processes_default_to_one_per_seven_spare_cores(monkeypatch):
    from atom import config

    monkeypatch.setattr(config, "available_cores", lambda: 16)
    assert EngineConfig().grammar_processes("cuda") == 2
    assert EngineConfig().grammar_processes("cpu") == 0
    speculative = {"speculative_method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(**speculative).grammar_processes("cuda") == 1
    assert EngineConfig(structured_output_grammar_processes=3).grammar_processes("cuda") == 3
    monkeypatch.setattr(config, "available_cores", lambda: 8)
    assert EngineConfig().grammar_processes("cuda") == 1
    with pytest.raises(ValueError, match="structured_output_grammar_processes"):
        EngineConfig(structured_output_grammar_processes=2, **speculative)
    with pytest.raises(ValueError, match="structured_output_grammar_processes"):
        EngineConfig(structured_output_grammar_processes=0)


@pytest.mark.gpu
def test_a_board_dropped_without_shutdown_ends_its_page_lock():
    """A board's page lock ends with the board: an engine collected without ``shutdown`` once
    left its board locked after the memory was unmapped, and the next board mapped at that
    address failed to lock (the kernel hands a freed range of that size out again)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device, addresses = torch.device("cuda"), []
    for _ in range(3):
        board = GrammarBoard.create(max_rows=64, num_words=4040)
        board.unlink()
        board.pin(device)
        addresses.append(board.raw.data_ptr())
        del board
        gc.collect()
    assert len(set(addresses)) < len(addresses)  # the test mapped one address twice
    assert torch.ones(4, device=device).sum().item() == 4  # no CUDA error left behind
    again = GrammarBoard.create(max_rows=64, num_words=4040)
    again.unlink()
    again.pin(device)
    again.unpin()
    again.unpin()  # idempotent, as shutdown may follow a finalizer
