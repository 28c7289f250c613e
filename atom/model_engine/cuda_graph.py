"""CUDA graphs of the decode forward, one per padded batch size.

A decode step (one new token per sequence) launches the same kernels in the same order at a
given batch size; only the data change. Launching them one by one from Python costs far more
host time than a small model's GPU work, so the forward is captured once per size in
`graph_batch_sizes` into static input buffers, and a decode step copies its inputs in and
replays the graph of the smallest size that holds its batch. The rows past the batch are the
padding rows of `StepInputs`; they touch nothing and their outputs are never read.

The graph ends at the hidden states: the LM head runs outside on the sampled rows only (as in
eager mode), and so do the grammar mask and the sampler, which depend on the host.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from atom.model_engine.step_inputs import StepInputs
from atom.model_ops.context import AttentionContext, set_context


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to `max_num_seqs`, which is always one of them
    so that every decode batch has a graph."""
    small = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class DecodeGraphs:
    """The captured decode forwards of one model and KV cache, and their static buffers."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks: int, device: torch.device):
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # hidden states [size, hidden], graph-owned

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so that the smaller graphs reuse its memory pool.

        Each size first runs once outside capture, so that Triton compiles its kernels for
        these shapes and cuBLAS picks its algorithms and workspace before anything is recorded.
        The buffers hold padding rows meanwhile: nothing is written to the KV cache.
        """
        pool = None
        for size in reversed(self.sizes):
            set_context(self._context(size))
            self._forward(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        set_context(None)
        torch.cuda.synchronize()

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size that replays a decode batch of `num_seqs`, None if none holds it."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, step: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Copy a decode step padded to a captured size into the buffers and replay; returns
        the hidden states of all its rows (valid until the next replay). `input_ids` are the
        step's ids on the device, placeholders filled.

        Block-table columns past the step's width keep older ids: a row's kernel reads only the
        blocks its context length covers, which all lie within the width."""
        size, width = step.block_tables.shape
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:size].copy_(step.slot_mapping, non_blocking=True)
        self.context_lens[:size].copy_(step.context_lens, non_blocking=True)
        self.block_tables[:size, :width].copy_(step.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size]

    def _context(self, size: int) -> AttentionContext:
        return AttentionContext(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_lens=self.query_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_query_len=1,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size])
