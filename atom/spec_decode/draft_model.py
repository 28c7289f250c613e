"""Drafts from a smaller model that shares the target's tokenizer, paged like the target.

The draft model has its own KV cache with the target's block geometry (as many blocks, of the
same size), so a sequence's block table, which the scheduler manages for the target, addresses
its draft K/V too. A proposal first feeds the draft model the sequence's tokens it has not seen
(the whole prompt the first time; then the tokens the last verification emitted), then k - 1
single-token steps, each feeding the previous draft: greedy drafts, so the proposal is
deterministic and the verification treats each draft as one-hot (exact at any temperature).

Draft K/V written for a draft that the target then rejected is stale: the next proposal counts
as valid only the positions whose drafts match the tokens that were emitted there, and feeds the
draft model again from the first that does not. A preempted sequence (its blocks were given
back) starts over. The engine gives a sequence blocks for the positions drafts are written at
(`needs_slots`) before it asks for a proposal.

On CUDA the k - 1 single-token steps replay the draft model's own decode graphs, and the first
step too when every request's unseen tokens are at most k + 1 (what a verification emits, so
every proposal after a sequence's first) in graphs of that many tokens a sequence
(`capture_graphs`): every request of the proposal takes each step (a request past its
`max_drafts` is a padding row: no context, no K/V write), each step's input is the previous
step's greedy token on the device, and the host reads the drafts once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from atom.model_engine.cuda_graph import DecodeGraphs
from atom.model_loader.weights import build_model, load_hf_config
from atom.model_ops.attention import prepare_attention
from atom.model_ops.context import AttentionContext, set_context
from atom.model_ops.sampler import argmax_rows
from atom.models.llama import head_dim_of
from atom.spec_decode.proposer import DraftRequest, Proposal

__all__ = ["DraftModelProposer"]


@dataclass
class _Drafted:
    """What the draft model has seen of a sequence: K/V for its first `valid` positions, and the
    drafts of its last proposal, written from position `start`."""

    generation: int
    valid: int
    start: int = 0
    drafts: tuple[int, ...] = ()


class DraftModelProposer:
    needs_slots = True

    def __init__(
        self, path: str, dtype: torch.dtype, device: torch.device, vocab_size: int
    ) -> None:
        self.hf_config = load_hf_config(Path(path))
        if self.hf_config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.hf_config.vocab_size}) is not the "
                f"target's ({vocab_size}): they must share the tokenizer"
            )
        self.dtype, self.device = dtype, device
        self.model = build_model(self.hf_config, Path(path), dtype, device)
        self.block_size = 0
        self.graphs: DecodeGraphs | None = None
        self.chunk_graphs: DecodeGraphs | None = None
        self._seen: dict[int, _Drafted] = {}

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of the draft model (the engine sizes both caches together)."""
        attn = self.model.model.layers[0].self_attn
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = 2 * attn.num_kv_heads * head_dim_of(self.hf_config) * elem
        return self.hf_config.num_hidden_layers * block_size * per_token

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        attn = self.model.model.layers[0].self_attn
        shape = (2, len(self.model.model.layers), num_blocks, block_size, attn.num_kv_heads)
        shape += (head_dim_of(self.hf_config),)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]
        self.block_size = block_size

    def capture_graphs(self, max_num_seqs: int, max_blocks: int, chunk_len: int) -> None:
        """Graphs of the draft model over its cache (after `allocate_cache`, CUDA only): decode
        steps, and first steps of up to `chunk_len` unseen tokens a sequence."""
        self.graphs = DecodeGraphs(self.model, max_num_seqs, max_blocks, self.device)
        self.graphs.capture()
        self.chunk_graphs = DecodeGraphs(
            self.model, max_num_seqs, max_blocks, self.device, chunk_len
        )
        self.chunk_graphs.capture()

    def release(self, seq_id: int) -> None:
        self._seen.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Greedy drafts for every request (up to its `max_drafts`)."""
        if not requests:
            return Proposal([])
        chunks = [self._unseen(r) for r in requests]
        if self.graphs is not None:
            drafts = self._propose_in_graphs(requests, chunks, self.graphs)
        else:
            drafts = self._propose_eagerly(requests, chunks)
        for r, d in zip(requests, drafts, strict=True):
            seen = self._seen[r.seq_id]
            seen.valid = r.num_known + max(0, len(d) - 1)
            seen.start, seen.drafts = r.num_known, tuple(d)
        return Proposal(drafts)

    def _propose_eagerly(
        self, requests: list[DraftRequest], chunks: list[tuple[int, list[int]]]
    ) -> list[list[int]]:
        """Each step over the requests that want another draft, read back after each step."""
        tokens = self._forward(requests, chunks).tolist()
        drafts: list[list[int]] = [[] for _ in requests]
        for step in range(max(r.max_drafts for r in requests)):
            live = [i for i, r in enumerate(requests) if r.max_drafts > step]
            for i in live:
                drafts[i].append(tokens[i])
            live = [i for i in live if requests[i].max_drafts > step + 1]
            if not live:
                break
            fed = self._forward(
                [requests[i] for i in live],
                [(requests[i].num_known + step, [tokens[i]]) for i in live],
            ).tolist()
            tokens = dict(zip(live, fed, strict=True))
        return drafts

    def _propose_in_graphs(
        self,
        requests: list[DraftRequest],
        chunks: list[tuple[int, list[int]]],
        graphs: DecodeGraphs,
    ) -> list[list[int]]:
        """The first step (`_first_step`), the others in `graphs`."""
        steps = max(r.max_drafts for r in requests)
        size = graphs.padded_size(len(requests))
        assert size is not None, "a proposal never has more requests than max_num_seqs"
        pad = size - len(requests)
        width = max(len(r.block_table) for r in requests)
        tables = [0] * (size * width)
        for i, r in enumerate(requests):
            tables[i * width : i * width + len(r.block_table)] = r.block_table
        block_tables = self._pinned(tables, torch.int32).view(size, width)
        tokens = self._first_step(requests, chunks, block_tables[: len(requests)])
        drafted = [tokens]
        for step in range(1, steps):
            positions, slots, context_lens = [], [], []
            for r in requests:
                p = r.num_known + step - 1  # where the previous draft goes
                live = step < r.max_drafts
                positions.append(p)
                slots.append(self._slot(r, p) if live else -1)
                context_lens.append(p + 1 if live else 0)
            hidden = graphs.replay_tensors(
                torch.nn.functional.pad(tokens, (0, pad)),
                self._pinned(positions + [0] * pad, torch.long),
                self._pinned(slots + [-1] * pad, torch.long),
                self._pinned(context_lens + [0] * pad, torch.int32),
                block_tables,
            )
            logits = self.model.compute_logits(hidden[: len(requests)])
            tokens = argmax_rows(logits)
            drafted.append(tokens)
        table = torch.stack(drafted, dim=1).tolist()  # the one host read
        return [row[: r.max_drafts] for row, r in zip(table, requests, strict=True)]

    def _first_step(
        self,
        requests: list[DraftRequest],
        chunks: list[tuple[int, list[int]]],
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """The first draft step's greedy tokens: in `chunk_graphs` when every chunk fits."""
        graphs = self.chunk_graphs
        lens = [len(t) for _, t in chunks]
        size = graphs.padded_size(len(requests)) if graphs is not None else None
        if graphs is None or size is None or max(lens) > graphs.query_len:
            return self._forward(requests, chunks)
        ids, positions, slots = self._rows(requests, chunks)
        ends = list(accumulate(lens))
        hidden = graphs.replay_packed(
            self._pinned(ids, torch.long).to(self.device, non_blocking=True),
            self._pinned(positions, torch.long),
            self._pinned(slots, torch.long),
            self._pinned([s + len(t) for s, t in chunks], torch.int32),
            block_tables,
            self._pinned([0, *ends], torch.int32).to(self.device, non_blocking=True),
            size,
        )
        last = self._pinned([e - 1 for e in ends], torch.long).to(self.device, non_blocking=True)
        return argmax_rows(self.model.compute_logits(hidden.index_select(0, last)))

    def _rows(
        self, requests: list[DraftRequest], chunks: list[tuple[int, list[int]]]
    ) -> tuple[list[int], list[int], list[int]]:
        """Input ids, positions and KV slots of the chunks' tokens, packed."""
        ids, positions, slots = [], [], []
        for r, (start, tokens) in zip(requests, chunks, strict=True):
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [self._slot(r, p) for p in range(start, start + len(tokens))]
        return ids, positions, slots

    def _slot(self, request: DraftRequest, position: int) -> int:
        block = request.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _pinned(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).pin_memory()

    def _unseen(self, request: DraftRequest) -> tuple[int, list[int]]:
        """(first position, tokens) the draft model has not seen: from the first position whose
        K/V is not valid any more up to the last known token."""
        seen = self._seen.get(request.seq_id)
        if seen is None or seen.generation != request.generation:
            seen = self._seen[request.seq_id] = _Drafted(request.generation, 0)
        known = request.token_ids
        valid = min(seen.valid, request.num_known - 1)
        if seen.drafts:  # the drafts written from `start` count while they match what came
            matched = 0
            for j, draft in enumerate(seen.drafts[: valid - seen.start]):
                if known[seen.start + j] != draft:
                    break
                matched = j + 1
            valid = min(valid, seen.start + matched)
        return valid, list(known[valid : request.num_known])

    def _forward(
        self, requests: list[DraftRequest], chunks: list[tuple[int, list[int]]]
    ) -> torch.Tensor:
        """One draft forward over each request's chunk (first position, tokens); returns the
        greedy next token of each, on the device."""
        ids, positions, slots = self._rows(requests, chunks)
        query_lens = [len(t) for _, t in chunks]
        width = max(len(r.block_table) for r in requests)
        tables = [list(r.block_table) + [0] * (width - len(r.block_table)) for r in requests]
        dev = self.device
        ctx = AttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(
                [s + len(t) for s, t in chunks], dtype=torch.int32, device=dev
            ),
            query_lens=torch.tensor(query_lens, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor(
                list(accumulate(query_lens, initial=0)), dtype=torch.long, device=dev
            ),
            max_query_len=max(query_lens),
        )
        prepare_attention(ctx, self.block_size)
        set_context(ctx)
        try:
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
            )
        finally:
            set_context(None)
        last = torch.tensor([n - 1 for n in accumulate(query_lens)], dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return argmax_rows(logits)
