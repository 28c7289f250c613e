"""Token embedding and LM head, sharded over the vocabulary.

`num_embeddings` is the padded row count (a multiple of `padding_size`), which may exceed the
checkpoint's `org_vocab_size`; each rank owns rows `[vocab_start, vocab_end)`. Padding rows never
reach the sampler: `ParallelLMHead.compute_logits` trims logits to `org_vocab_size`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from atom.model_ops.parallel import all_reduce, tp_rank, tp_size

DEFAULT_VOCAB_PADDING = 64


def pad_vocab(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        org_vocab_size: int,
        embedding_dim: int,
        padding_size: int = DEFAULT_VOCAB_PADDING,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.org_vocab_size = org_vocab_size
        self.num_embeddings = pad_vocab(org_vocab_size, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows; rows past the checkpoint's vocabulary stay zero."""
        end = min(self.vocab_end, loaded.size(0))
        if end > self.vocab_start:
            param.data[: end - self.vocab_start].copy_(loaded[self.vocab_start : end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, 0)
        y = F.embedding(local, self.weight) * mask.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection: each rank computes its vocab slice, rank slices are all-gathered."""

    def __init__(
        self,
        org_vocab_size: int,
        embedding_dim: int,
        bias: bool = False,
        padding_size: int = DEFAULT_VOCAB_PADDING,
    ):
        super().__init__(org_vocab_size, embedding_dim, padding_size)
        assert not bias, "LM head bias is not supported"

    def tie_weights(self, embed: VocabParallelEmbedding) -> None:
        self.weight = embed.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, org_vocab_size] in the weights' dtype.

        Not upcast here: greedy argmax and the grammar mask give the same result on them (the
        float32 upcast is exact), and at batch 256 with a 129,280-token vocabulary the upcast
        alone is 5% of a decode step's GPU time. What needs float32 (log-softmax, sampling with
        a temperature) upcasts itself."""
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        if logits.size(-1) == self.org_vocab_size:
            return logits
        return logits[:, : self.org_vocab_size].contiguous()
