"""Logit changes a request asks for before sampling, with vLLM's meanings and in its order:
`logit_bias`, `min_tokens` (stop tokens forbidden until then), then the repetition penalty
(tokens of the prompt or the output: positive logits divided, negative multiplied), the
frequency penalty (times each token's count in the output) and the presence penalty (once per
token in the output).

Only the rows that ask are touched (`PenaltyTensors.rows`): a batch without such a row never
builds any of this. Runs before the grammar mask, which then forbids what it forbids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyTensors:
    """The penalized rows of one batch, on the logits' device."""

    rows: torch.Tensor  # [R] long: rows of the logits
    output_ids: torch.Tensor  # [R, L] long: output tokens so far, padded with the vocab size
    prompt_ids: torch.Tensor | None  # [R, P] long, padded likewise; None: no repetition penalty
    presence: torch.Tensor  # [R] float
    frequency: torch.Tensor  # [R] float
    repetition: torch.Tensor  # [R] float, 1.0 where off
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token id, value)
    forbidden: tuple[torch.Tensor, torch.Tensor] | None  # (row, token id): min_tokens


def _seen(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] bool: which tokens appear in each row of a padded id matrix."""
    seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids, True)[:, :vocab]


def apply_penalties(logits: torch.Tensor, t: PenaltyTensors) -> None:
    """Change the penalized rows of `logits` [N, V] in place (computed in float32)."""
    vocab = logits.shape[1]
    sub = logits.index_select(0, t.rows).float()
    if t.bias is not None:
        row, token, value = t.bias
        sub.index_put_((row, token), value, accumulate=True)
    if t.forbidden is not None:
        sub.index_put_(t.forbidden, torch.tensor(float("-inf"), device=sub.device))
    counts = torch.zeros(sub.shape[0], vocab + 1, device=sub.device)
    counts = counts.scatter_add_(1, t.output_ids, torch.ones_like(t.output_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    present = counts > 0
    if t.prompt_ids is not None:
        seen = present | _seen(t.prompt_ids, vocab)
        penalty = t.repetition.unsqueeze(1)
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, scaled, sub)
    sub -= t.frequency.unsqueeze(1) * counts + t.presence.unsqueeze(1) * present
    logits.index_copy_(0, t.rows, sub.to(logits.dtype))


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def build_penalties(
    rows: list[int],
    params: list,
    outputs: list[list[int]],
    prompts: list[list[int]],
    vocab: int,
) -> PenaltyTensors:
    """Host tensors of the penalized `rows` (move them with `to`); `params[i]` is the
    SamplingParams of `rows[i]`, `outputs[i]` its output tokens so far (a negative id, a token
    not read yet, is padding until the caller fills it) and `prompts[i]` its prompt."""
    outputs = [[t if t >= 0 else vocab for t in out] for out in outputs]
    repetition = [p.repetition_penalty for p in params]
    bias = [(r, tok, v) for r, p in enumerate(params) for tok, v in (p.logit_bias or {}).items()]
    forbidden = [
        (r, tok)
        for r, (p, out) in enumerate(zip(params, outputs, strict=True))
        if len(out) < p.min_tokens
        for tok in p.min_tokens_stop_ids
    ]
    return PenaltyTensors(
        rows=torch.tensor(rows, dtype=torch.long),
        output_ids=_padded(outputs, vocab),
        prompt_ids=_padded(prompts, vocab) if any(r != 1.0 for r in repetition) else None,
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        repetition=torch.tensor(repetition, dtype=torch.float32),
        bias=tuple(torch.tensor(c) for c in zip(*bias, strict=True)) if bias else None,  # type: ignore[arg-type]
        forbidden=tuple(torch.tensor(c) for c in zip(*forbidden, strict=True))
        if forbidden
        else None,  # type: ignore[arg-type]
    )


def to_device(t: PenaltyTensors, device: torch.device) -> PenaltyTensors:
    """The same tensors on `device` (non-blocking from pinned memory on CUDA)."""

    def move(x):
        if x is None:
            return None
        if isinstance(x, tuple):
            return tuple(move(v) for v in x)
        return x.to(device, non_blocking=True)

    return PenaltyTensors(*(move(getattr(t, f)) for f in t.__dataclass_fields__))
