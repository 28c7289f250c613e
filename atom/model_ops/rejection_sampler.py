"""Speculative decoding: verify each sequence's draft tokens against the target model's logits.

Layout. Sequence i brings ``k_i >= 0`` draft tokens and ``k_i + 1`` consecutive logits rows: row j
scores the token after the prompt plus the first j drafts, the last row (the bonus row) the token
after all of them. Draft-order tensors (``[sum k_i, ...]``) list the drafts sequence by sequence.

Greedy rows (temperature 0) accept drafts while each is the argmax of its row, then emit the
argmax of the first mismatching row (or of the bonus row): token for token what greedy decoding
without speculation produces. Rows with a temperature use speculative sampling (Leviathan et al.
2023, Chen et al. 2023): draft d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), the
first rejection emits a sample of normalize(max(0, p_j - q_j)) and stops, and when all are
accepted the bonus token is a sample of p_{k+1}. The emitted tokens then follow the target
distribution exactly, whatever q is. A deterministic proposer (n-gram) means q = one-hot at the
draft: accept with probability p_j(d_j), else sample p_j without d_j. A draft with p_j(d_j) = 0
(a -inf, e.g. grammar-forbidden, logit) is never accepted, and no emitted token has zero target
probability.

Randomness mirrors `sampler.py`: a uniform per draft and one Exp(1) noise row per sequence (the
emitted token is argmax(residual / noise), a categorical draw), from the sequence's own
`torch.Generator` where it has one, so a seeded request's tokens do not depend on the batch.

Device work. Everything runs on the logits' device with batched tensor ops; the host only builds
the index tensors from the draft lists (one host-to-device copy, non-blocking on CUDA) and loops
over seeded sequences to draw their numbers. `rejection_sample` never waits for the device: its
result holds device tensors, and `Verification.tolist` is the one host read.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from atom.model_ops.sampler import SamplingTensors, _apply_top_k_top_p, argmax_rows


@dataclass
class RelaxedAcceptance:
    """Relaxed MTP acceptance: a draft is also accepted when it is among its row's `top_n` most
    likely tokens and its probability is within `delta` of the row's largest (both, as the
    upstream ATOM flag and TensorRT-LLM do; `delta=1` leaves top-N alone, `top_n=V` leaves delta
    alone). A draft of zero target probability is never accepted.

    This changes the output distribution (greedy: no longer exactly greedy; sampling: no longer
    exactly the target's), which is why it is opt-in per sequence and only for unconstrained
    requests: `seqs[i]` says whether sequence i may use it. Probabilities are the row's target
    distribution (after temperature, top-k/top-p; greedy rows: softmax of the raw logits).
    """

    top_n: int
    delta: float
    seqs: list[bool]


@dataclass
class Verification:
    """Device result of one verification step."""

    token_ids: torch.Tensor  # [N, max k_i + 1] long; -1 after each sequence's last emitted token
    num_accepted: torch.Tensor  # [N] long: accepted drafts; sequence i emits num_accepted[i] + 1

    def tolist(self) -> tuple[list[list[int]], list[int]]:
        """Emitted tokens per sequence and accepted-draft counts: the one host read (a device
        sync on CUDA)."""
        width = self.token_ids.size(1)
        flat = torch.cat([self.token_ids.flatten(), self.num_accepted]).tolist()
        accepted = flat[self.token_ids.numel() :]
        tokens = [flat[i * width : i * width + n + 1] for i, n in enumerate(accepted)]
        return tokens, accepted


@dataclass
class _Layout:
    """Where each sequence's rows and drafts are; host lists for the seeded-draw loop."""

    num_drafts_host: list[int]
    draft_start_host: list[int]  # index of each sequence's first draft in draft order
    row_start: torch.Tensor  # [N]
    num_drafts: torch.Tensor  # [N]
    seq_of_row: torch.Tensor  # [R]
    draft_rows: torch.Tensor  # [D] the row that scores each draft
    drafts: torch.Tensor  # [D]

    @property
    def draft_start(self) -> torch.Tensor:
        """[N]: a sequence's drafts start where its rows do, less one bonus row per sequence
        before it."""
        return self.row_start - torch.arange(len(self.row_start), device=self.row_start.device)

    @property
    def draft_seq(self) -> torch.Tensor:
        return self.seq_of_row[self.draft_rows]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device, through pinned memory on CUDA (no host wait)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _layout(draft_token_ids: list[list[int]], num_rows: int, device: torch.device) -> _Layout:
    ks = [len(d) for d in draft_token_ids]
    if sum(ks) + len(ks) != num_rows:
        need = sum(ks) + len(ks)
        raise ValueError(f"{num_rows} logits rows for {len(ks)} sequences that need {need}")
    row_start = list(accumulate((k + 1 for k in ks), initial=0))[:-1]
    seq_of_row = [i for i, k in enumerate(ks) for _ in range(k + 1)]
    draft_rows = [start + j for start, k in zip(row_start, ks, strict=True) for j in range(k)]
    drafts = [t for d in draft_token_ids for t in d]
    flat = _to_device(row_start + ks + seq_of_row + draft_rows + drafts, torch.long, device)
    parts = flat.split([len(ks), len(ks), num_rows, len(drafts), len(drafts)])
    draft_start = list(accumulate(ks, initial=0))[:-1]
    return _Layout(ks, draft_start, *parts)


def rejection_sample(
    logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    sampling: SamplingTensors,
    draft_probs: torch.Tensor | None = None,
    relaxed: RelaxedAcceptance | None = None,
) -> Verification:
    """Verify the drafts of N sequences in one batch.

    logits: [sum(k_i + 1), V] target logits in any float dtype, possibly masked with -inf.
    draft_token_ids: per sequence its k_i drafts.
    sampling: per-sequence settings (N entries, as `Sampler` takes them per row).
    draft_probs: [sum k_i, V] the draft model's distributions the drafts were sampled from, or
    None for a deterministic proposer (q one-hot at each draft).
    relaxed: optional relaxed acceptance (see `RelaxedAcceptance`).
    """
    layout = _layout(draft_token_ids, logits.size(0), logits.device)
    if draft_probs is not None and draft_probs.shape != (len(layout.drafts), logits.size(1)):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} for {len(layout.drafts)} drafts")
    greedy_ids = argmax_rows(logits)
    probs = None if sampling.temperatures is None else _target_probs(logits, layout, sampling)
    if probs is None:
        accepted = greedy_ids[layout.draft_rows] == layout.drafts
    else:
        uniforms, noise = _draws(layout, sampling.generators, logits.size(1), logits.device)
        accepted = _accept(greedy_ids, probs, layout, sampling, draft_probs, uniforms)
    if relaxed is not None:
        accepted |= _relaxed_ok(logits, probs, layout, sampling, relaxed)
    num_accepted = _num_accepted(accepted, layout)
    final_rows = layout.row_start + num_accepted
    final = greedy_ids[final_rows]
    if probs is not None:
        residual = _residual(probs[final_rows], num_accepted, layout, draft_probs)
        sampled = argmax_rows(residual.div(noise))
        final = torch.where(sampling.temperatures == 0, final, sampled)
    return Verification(_emitted(layout, num_accepted, final), num_accepted)


def _target_probs(logits: torch.Tensor, layout: _Layout, t: SamplingTensors) -> torch.Tensor:
    """[R, V] float32 target distributions with each row's sequence's temperature, top-k and
    top-p (greedy sequences' rows at temperature 1; they are only read through the argmax)."""
    rows = layout.seq_of_row
    temps = t.temperatures[rows]
    temps = torch.where(temps == 0, 1.0, temps).unsqueeze(1)
    top_ks = None if t.top_ks is None else t.top_ks[rows]
    top_ps = None if t.top_ps is None else t.top_ps[rows]
    return _apply_top_k_top_p(logits.float() / temps, top_ks, top_ps).softmax(dim=-1)


def _draws(
    layout: _Layout, generators: list[torch.Generator | None], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform per draft and an Exp(1) noise row per sequence. Unseeded sequences share the
    global RNG; a seeded one draws its k_i uniforms, then its noise row, from its generator."""
    uniforms = torch.rand(len(layout.drafts), device=device)
    noise = torch.empty(len(generators), vocab, device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            start = layout.draft_start_host[i]
            uniforms[start : start + layout.num_drafts_host[i]].uniform_(generator=gen)
            noise[i].exponential_(generator=gen)
    return uniforms, noise


def _accept(
    greedy_ids: torch.Tensor,
    probs: torch.Tensor,
    layout: _Layout,
    t: SamplingTensors,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """[D] bool: greedy drafts equal their row's argmax; sampled drafts pass u < p(d) / q(d),
    written u * q(d) < p(d) so that p(d) = 0 always rejects and q(d) = 0 never divides."""
    drafts = layout.drafts
    p_draft = probs[layout.draft_rows, drafts]
    q_draft = 1.0
    if draft_probs is not None:
        q_draft = draft_probs[torch.arange(len(drafts), device=drafts.device), drafts].float()
    sampled_ok = uniforms * q_draft < p_draft
    greedy_ok = greedy_ids[layout.draft_rows] == drafts
    return torch.where((t.temperatures == 0)[layout.draft_seq], greedy_ok, sampled_ok)


def _relaxed_ok(
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    layout: _Layout,
    t: SamplingTensors,
    relaxed: RelaxedAcceptance,
) -> torch.Tensor:
    """[D] bool: drafts the relaxed rule accepts (see `RelaxedAcceptance`)."""
    rows = logits[layout.draft_rows].float().softmax(dim=-1)
    if probs is not None:
        greedy = (t.temperatures == 0)[layout.draft_seq].unsqueeze(1)
        rows = torch.where(greedy, rows, probs[layout.draft_rows])
    p_draft = rows.gather(1, layout.drafts.unsqueeze(1))
    rank = (rows > p_draft).sum(dim=-1)
    near_top = p_draft.squeeze(1) >= rows.max(dim=-1).values - relaxed.delta
    allowed = _to_device(relaxed.seqs, torch.bool, logits.device)
    return allowed[layout.draft_seq] & (p_draft.squeeze(1) > 0) & (rank < relaxed.top_n) & near_top


def _num_accepted(accepted: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[N]: the length of each sequence's run of accepted drafts from its first."""
    width = max(layout.num_drafts_host, default=0)
    offsets = torch.arange(width, device=accepted.device)
    index = (layout.draft_start.unsqueeze(1) + offsets).clamp(max=len(accepted))
    padded = torch.cat([accepted, accepted.new_zeros(1)])[index]  # past the end: not accepted
    padded &= offsets < layout.num_drafts.unsqueeze(1)
    return padded.long().cumprod(dim=1).sum(dim=1)


def _residual(
    p: torch.Tensor, num_accepted: torch.Tensor, layout: _Layout, draft_probs: torch.Tensor | None
) -> torch.Tensor:
    """[N, V] unnormalized distribution of each sequence's last emitted token: max(0, p - q) at
    a rejection, p at the bonus row, and p again where max(0, p - q) has no mass left (p == q up
    to rounding: then the rejection was a rounding artefact)."""
    if len(layout.drafts) == 0:
        return p
    at = (layout.draft_start + num_accepted).clamp(max=len(layout.drafts) - 1)
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(1, layout.drafts[at].unsqueeze(1), 1.0)
    else:
        q = draft_probs[at].float()
    rejected = (num_accepted < layout.num_drafts).unsqueeze(1)
    residual = torch.where(rejected, (p - q).clamp(min=0), p)
    return torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)


def _emitted(layout: _Layout, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[N, max k_i + 1]: accepted drafts, then the final token, then -1."""
    width = max(layout.num_drafts_host, default=0) + 1
    offsets = torch.arange(width, device=final.device)
    index = (layout.draft_start.unsqueeze(1) + offsets).clamp(max=len(layout.drafts))
    tokens = torch.cat([layout.drafts, layout.drafts.new_full((1,), -1)])[index]
    n = num_accepted.unsqueeze(1)
    tokens = torch.where(offsets < n, tokens, -1)
    return torch.where(offsets == n, final.unsqueeze(1), tokens)
