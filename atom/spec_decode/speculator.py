"""A rank's speculative decoding: its draft proposer, and the verification of a step's drafts.

The model runner owns one when `EngineConfig.speculative_method` is set. After a step's output is
read (with asynchronous scheduling: after the next step is queued), the engine asks it for each
sequence's next drafts (`propose`); the scheduler gives a decode row up to
`num_speculative_tokens` of them, the step's forward scores every draft prefix (the row becomes a
short chunk: its last token and its drafts), constrained rows are masked with the grammar state
after each prefix, and `verify` emits per sequence the accepted drafts plus one token. Only the
emitted tokens join the sequence; the K/V written for rejected drafts lies past its computed
tokens and is overwritten by later steps.
"""

from __future__ import annotations

import torch

from atom import envs
from atom.config import EngineConfig
from atom.model_engine.deferred_output import VerifiedOutput
from atom.model_engine.sequence import Sequence
from atom.model_ops.rejection_sampler import RelaxedAcceptance, rejection_sample
from atom.model_ops.sampler import SamplingTensors
from atom.spec_decode.draft_model import DraftModelProposer
from atom.spec_decode.ngram import NgramProposer
from atom.spec_decode.proposer import DraftRequest, Proposer

__all__ = ["Speculator"]


class Speculator:
    def __init__(
        self, config: EngineConfig, dtype: torch.dtype, device: torch.device, vocab_size: int
    ) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer: Proposer
        self.draft_model: DraftModelProposer | None = None
        if config.speculative_method == "draft":
            assert config.speculative_model is not None
            self.draft_model = DraftModelProposer(
                config.speculative_model, dtype, device, vocab_size
            )
            self.proposer = self.draft_model
        else:
            self.proposer = NgramProposer()

    def block_bytes(self, block_size: int) -> int:
        """Bytes a KV block costs the draft model (0 for n-gram lookup)."""
        return 0 if self.draft_model is None else self.draft_model.block_bytes(block_size)

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        if self.draft_model is not None:
            self.draft_model.allocate_cache(num_blocks, block_size)

    def capture_graphs(self, max_num_seqs: int, max_blocks: int, chunk_len: int) -> None:
        """CUDA graphs of the draft model's steps (none for n-gram lookup)."""
        if self.draft_model is not None:
            self.draft_model.capture_graphs(max_num_seqs, max_blocks, chunk_len)

    def propose(
        self,
        seqs: list[Sequence],
        max_drafts: list[int],
        in_flight: list[list[int]] | None = None,
    ) -> dict[int, list[int]]:
        """Next drafts by sequence id (the tokens read so far are the proposer's input), at
        most `max_drafts[i]` for `seqs[i]`. With asynchronous scheduling a step of each is in
        flight: `in_flight[i]` are the drafts it verifies (see `DraftRequest.in_flight`)."""
        ahead = in_flight if in_flight is not None else [None] * len(seqs)
        requests = [
            DraftRequest(
                s.seq_id, s.token_ids, s.num_known_tokens, k, s.block_table, s.num_preemptions, d
            )
            for s, k, d in zip(seqs, max_drafts, ahead, strict=True)
        ]
        proposal = self.proposer.propose(requests)
        return {r.seq_id: d for r, d in zip(requests, proposal.token_ids, strict=True)}

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.proposer.release(seq_id)

    def verify(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: list[list[int]],
        sampling: SamplingTensors,
        errors: dict[int, str],
        copy_stream: torch.cuda.Stream | None = None,
    ) -> VerifiedOutput:
        """Queue the verification of `drafts` (per sampling sequence, in logits row order);
        with `ATOM_ENABLE_RELAXED_MTP=1` unconstrained rows accept drafts near the top too."""
        relaxed = None
        if envs.enable_relaxed_mtp():
            relaxed = RelaxedAcceptance(
                envs.relaxed_mtp_top_n(),
                envs.relaxed_mtp_delta(),
                [s.params.structured_output is None for s in seqs],
            )
        verification = rejection_sample(logits, drafts, sampling, relaxed=relaxed)
        return VerifiedOutput([s.seq_id for s in seqs], verification, errors, copy_stream)
