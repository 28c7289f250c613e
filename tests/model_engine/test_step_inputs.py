"""Step inputs against per-token formulas: random batches of decode rows (with and without a
placeholder input), prefill chunks spanning blocks, padding rows, sampled and unsampled rows;
and a runner's steady decode steps (advanced from the step before) against full builds."""

from __future__ import annotations

import random

import pytest
import torch

from atom.config import EngineConfig
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.scheduler import ScheduledBatch, Scheduler
from atom.model_engine.sequence import Sequence
from atom.model_engine.step_inputs import StepInputsBuilder, build_step_inputs
from atom.sampling_params import SamplingParams

BLOCK = 4


def _row(rng: random.Random, decode: bool) -> tuple[Sequence, int, int]:
    """A sequence and its row (sequence, first position, new tokens). Half the decode rows take
    their sequence's oldest placeholder as input (asynchronous scheduling); a chunk starts and
    ends anywhere."""
    prompt = [rng.randrange(5, 1000) for _ in range(rng.randrange(1, 30))]
    seq = Sequence("r", prompt, SamplingParams())
    if not decode:
        start = rng.randrange(len(prompt))
        n = rng.randrange(1, len(prompt) - start + 1)
    elif rng.random() < 0.5:
        seq.append_placeholder()  # the previous step's token, not read yet
        start, n = len(seq.token_ids) - 1, 1
        seq.append_placeholder()  # the token this step samples
    else:
        start, n = len(seq.token_ids) - 1, 1
    seq.block_table = rng.sample(range(1, 500), -(-(start + n) // BLOCK))
    return seq, start, n


def _batch(rows: list[tuple[Sequence, int, int]]) -> ScheduledBatch:
    return ScheduledBatch(
        seqs=[seq for seq, _, _ in rows],
        num_new_tokens=[n for _, _, n in rows],
        num_computed_before=[start for _, start, _ in rows],
        sampling=[start + n >= seq.num_known_tokens for seq, start, n in rows],
    )


def _expected(batch: ScheduledBatch, pad: int) -> dict:
    """Every field, token by token."""
    want: dict[str, list] = {
        k: [] for k in ("input_ids", "positions", "slot_mapping", "context_lens", "sample_rows")
    }
    want["placeholder_rows"], want["owners"] = [], []
    rows = zip(
        batch.seqs, batch.num_new_tokens, batch.num_computed_before, batch.sampling, strict=True
    )
    for seq, n, start, samples in rows:
        pending = seq.num_known_tokens  # the position of its oldest placeholder
        if start <= pending < start + n:
            want["placeholder_rows"].append(len(want["input_ids"]) + pending - start)
            want["owners"].append(seq.seq_id)
        for p in range(start, start + n):
            want["input_ids"].append(seq.token_ids[p])
            want["positions"].append(p)
            want["slot_mapping"].append(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
        want["context_lens"].append(start + n)
        if samples:
            want["sample_rows"].append(len(want["input_ids"]) - 1)
    width = max(len(seq.block_table) for seq in batch.seqs)
    tables = [seq.block_table for seq in batch.seqs]
    want["block_tables"] = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad
    for field, fill in (
        ("input_ids", 0),
        ("positions", 0),
        ("slot_mapping", -1),
        ("context_lens", 0),
    ):
        want[field] += [fill] * pad
    return want


@pytest.mark.parametrize("decode_only", [True, False])
def test_step_inputs_match_per_token_formulas(decode_only):
    rng = random.Random(int(decode_only))
    for _ in range(300):
        rows = [_row(rng, decode_only or rng.random() < 0.5) for _ in range(rng.randrange(1, 9))]
        batch = _batch(rows)
        pad = rng.randrange(3) if decode_only else 0  # CUDA graph padding: decode steps only
        step = build_step_inputs(batch, BLOCK, len(rows) + pad, pin=False)
        want = _expected(batch, pad)
        for field in ("input_ids", "positions", "slot_mapping", "sample_rows"):
            tensor = getattr(step, field)
            assert tensor.dtype == torch.long and tensor.tolist() == want[field], field
        for field in ("block_tables", "context_lens"):
            tensor = getattr(step, field)
            assert tensor.dtype == torch.int32 and tensor.tolist() == want[field], field
        assert step.query_lens == batch.num_new_tokens
        assert step.placeholder_rows == want["placeholder_rows"]
        assert step.placeholder_seq_ids == want["owners"]


def _scheduler() -> Scheduler:
    """The real scheduler over a small cache (preemption) and a small token budget (chunked
    prefill)."""
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=24, block_size=BLOCK)
    return Scheduler(config, BlockManager(num_blocks=16, block_size=BLOCK))


def _steady_workload(rng: random.Random, scheduler: Scheduler, async_scheduling: bool):
    """`scheduler`'s batches, with prompts sharing a prefix (prefix caching) and requests
    arriving and finishing as it runs; sampled tokens are random. Yields each batch when it is
    scheduled."""
    shared = [rng.randrange(5, 1000) for _ in range(9)]
    in_flight = None
    for i in range(600):
        if rng.random() < 0.1:
            prompt = shared[: rng.randrange(10)] + [rng.randrange(5, 1000) for _ in range(5)]
            params = SamplingParams(max_tokens=rng.randrange(1, 45))  # fits the cache
            scheduler.add(Sequence(f"r{i}", prompt, params))
        batch = scheduler.schedule()
        if batch.seqs:
            yield batch
        done = in_flight if async_scheduling else batch
        in_flight = batch if async_scheduling else None
        if done is not None and done.seqs:
            sampled = {seq.seq_id: rng.randrange(5, 1000) for seq in done.seqs}
            for seq, _ in scheduler.update(done, sampled):
                if seq.num_known_tokens >= seq.max_len or rng.random() < 0.02:
                    scheduler.finish(seq, "stop")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_steps_build_what_a_full_build_does(async_scheduling):
    """The runner's builder advances a steady decode step (`ScheduledBatch.steady`) from the
    step before; every step must equal a build that reads every sequence, field by field."""
    rng = random.Random(7)
    builder = StepInputsBuilder(BLOCK)
    scheduler = _scheduler()
    steps = steady = 0
    for batch in _steady_workload(rng, scheduler, async_scheduling):
        pad = rng.randrange(3) if max(batch.num_new_tokens) == 1 else 0
        rows = len(batch.seqs) + pad
        got = builder.build(batch, rows, pin=False)
        want = build_step_inputs(batch, BLOCK, rows, pin=False)
        for field in ("input_ids", "positions", "slot_mapping", "sample_rows", "context_lens"):
            assert getattr(got, field).tolist() == getattr(want, field).tolist(), field
        assert got.block_tables.tolist() == want.block_tables.tolist()
        assert got.placeholder_rows == want.placeholder_rows
        assert got.placeholder_seq_ids == want.placeholder_seq_ids
        assert got.placeholder_seqs == want.placeholder_seqs
        steps += 1
        steady += batch.steady
    assert steps > 300 and steady > steps // 4 and scheduler.num_preemptions > 5
