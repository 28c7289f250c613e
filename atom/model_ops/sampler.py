"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds; raw logprobs.

Sampling draws `argmax(probs / E)` with `E ~ Exp(1)` (equivalent to a categorical draw), so a
seeded request only needs its own exponential noise row from its own `torch.Generator`, and the
result does not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SamplingTensors:
    """Per-row settings of one batch, built by the model runner."""

    # [N] float, 0 means greedy; None when every row is greedy (the runner knows it on the host,
    # so the sampler never waits for the GPU to find out)
    temperatures: torch.Tensor | None
    top_ks: torch.Tensor | None  # [N] long (vocab size where disabled); None: no row uses it
    top_ps: torch.Tensor | None  # [N] float (1.0 where disabled); None: no row uses it
    generators: list[torch.Generator | None]  # per row; None uses the global RNG
    min_ps: torch.Tensor | None = None  # [N] float (0.0 where disabled); None: no row uses it


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [N, V]: on CUDA in two short launches
    (``triton_argmax``; torch's reduces a row in one block, 36 µs at batch 1 on the H200)."""
    if logits.is_cuda:
        from atom.model_ops.triton_argmax import argmax_rows_triton  # CPU never loads triton

        return argmax_rows_triton(logits)
    return logits.argmax(dim=-1)


@dataclass
class Logprobs:
    """Raw-distribution logprobs of the sampled tokens and the top candidates."""

    sampled: torch.Tensor  # [N] logprob of each sampled token
    top_ids: torch.Tensor  # [N, k]
    top: torch.Tensor  # [N, k] logprobs of top_ids


def compute_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top, top_ids = raw_logprobs.topk(num_top, dim=-1)
    return Logprobs(sampled, top_ids, top)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits [N, V] in any float dtype (possibly masked) -> token ids [N]; sampling with a
        temperature runs in float32."""
        greedy_ids = argmax_rows(logits)
        if t.temperatures is None:
            return greedy_ids
        greedy = t.temperatures == 0
        temps = torch.where(greedy, 1.0, t.temperatures).unsqueeze(1)
        logits = _apply_min_p(logits.float() / temps, t.min_ps)
        logits = _apply_top_k_top_p(logits, t.top_ks, t.top_ps)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()  # unseeded rows: the global RNG
        for row, gen in enumerate(t.generators):  # seeded rows: their own stream, as before
            if gen is not None:
                noise[row].exponential_(generator=gen)
        sampled = argmax_rows(probs.div(noise))
        return torch.where(greedy, greedy_ids, sampled)


def _apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf the logits whose probability is below min_p times the row's top one
    (after temperature): p < min_p * p_max, i.e. logit < max logit + log(min_p)."""
    if min_ps is None:
        return logits
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < top + min_ps.log().unsqueeze(1), float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf (one sort per batch)."""
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        ranks = torch.arange(logits.size(1), device=logits.device).unsqueeze(0)
        drop |= ranks >= top_ks.unsqueeze(1)
    if top_ps is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        drop |= mass_before >= top_ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
