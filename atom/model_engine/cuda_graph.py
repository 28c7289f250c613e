"""CUDA graphs of the decode forward, one per padded batch size.

A decode step (one new token per sequence) launches the same kernels in the same order at a
given batch size; only the data change. Launching them one by one from Python costs far more
host time than a small model's GPU work, so the forward is captured once per size in
`graph_batch_sizes` into static input buffers, and a decode step copies its inputs in and
replays the graph of the smallest size that holds its batch. The rows past the batch are the
padding rows of `StepInputs`; they touch nothing and their outputs are never read.

The graph ends at the hidden states: the LM head runs outside on the sampled rows only (as in
eager mode), and so do the grammar mask and the sampler, which depend on the host.

With speculative decoding, a second set (`query_len` = 1 + drafts per step) holds verification
steps: each sequence scores its last token and up to `query_len - 1` drafts, its rows packed one
after the other (the varlen kernel reads each sequence's row range from `cu_seqlens_q`, a
buffer like the others). The rows past the step's tokens and the sequences past its batch are
padding: no rows (an empty range), no KV writes (slot -1), never read.
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
    """The captured forwards of one model and KV cache for steps of up to `query_len` tokens a
    sequence, and their static buffers."""

    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        max_blocks: int,
        device: torch.device,
        query_len: int = 1,
    ):
        self.model = model
        self.query_len = query_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        n, t = self.sizes[-1], self.sizes[-1] * query_len
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_lens = torch.full((n,), query_len, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(0, t + 1, query_len, dtype=torch.int32, device=device)
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

    def replay_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        size: int,
    ) -> torch.Tensor:
        """Replay a step of at most `query_len` tokens a sequence, unpadded (its row offsets
        `cu_seqlens_q` on the device), in the graph of `size` sequences; returns the hidden
        states of its rows, packed as given. Padding: the sequences past the batch get an
        empty row range and no context, the rows past the step's tokens slot -1."""
        num_seqs, width = block_tables.shape
        tokens = input_ids.size(0)
        self.slot_mapping.fill_(-1)
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(slot_mapping, non_blocking=True)
        self.context_lens[:num_seqs].copy_(context_lens, non_blocking=True)
        self.context_lens[num_seqs:size].zero_()
        self.block_tables[:num_seqs, :width].copy_(block_tables, non_blocking=True)
        self.cu_seqlens_q[: num_seqs + 1].copy_(cu_seqlens_q)
        self.cu_seqlens_q[num_seqs + 1 : size + 1].fill_(tokens)
        self.graphs[size].replay()
        return self.outputs[size][:tokens]

    def replay(self, step: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Copy a decode step padded to a captured size into the buffers and replay; returns
        the hidden states of all its rows (valid until the next replay). `input_ids` are the
        step's ids on the device, placeholders filled.

        Block-table columns past the step's width keep older ids: a row's kernel reads only the
        blocks its context length covers, which all lie within the width."""
        return self.replay_tensors(
            input_ids, step.positions, step.slot_mapping, step.context_lens, step.block_tables
        )

    def replay_tensors(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """`replay` from the step's tensors, one row a sequence padded to a captured size (the
        draft model's decode steps have no `StepInputs`)."""
        size = self.stage(positions, slot_mapping, context_lens, block_tables)
        return self.launch(input_ids, size)

    def stage(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> int:
        """Copy a decode step's inputs but its ids into the buffers (queued on the stream after
        every replay queued before: each reads the buffers as they were); returns its size."""
        size, width = block_tables.shape
        self.positions[:size].copy_(positions, non_blocking=True)
        self.slot_mapping[:size].copy_(slot_mapping, non_blocking=True)
        self.context_lens[:size].copy_(context_lens, non_blocking=True)
        self.block_tables[:size, :width].copy_(block_tables, non_blocking=True)
        return size

    def launch(self, input_ids: torch.Tensor, size: int) -> torch.Tensor:
        """Replay the staged step of `size` with its ids; its hidden states (graph-owned)."""
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size]

    def _context(self, size: int) -> AttentionContext:
        return AttentionContext(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_lens=self.query_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_query_len=self.query_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        tokens = size * self.query_len
        return self.model(self.input_ids[:tokens], self.positions[:tokens])
