"""One rank's worker: owns the model and its KV cache, runs one scheduled batch per call.

inputs -> forward -> [commit acknowledged grammar tokens] -> logits (ParallelLMHead) -> raw
logprobs -> [grammar mask of constrained target rows] -> sampler.
Every public method is callable by name through `Executor.collective_rpc`.

The bracketed steps and the `structured_output_*` RPCs belong to this rank's
`StructuredOutputWorker`, created by the first of those RPCs; the runner only forwards to it, and
only for batches that carry constrained requests: an ordinary batch imports nothing of
`atom.structured_output`, allocates no mask buffer and loads no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atom.config import EngineConfig
from atom.model_engine.output import TokenLogprob
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import Sequence
from atom.model_loader.weights import build_model
from atom.model_ops.attention import prepare_attention
from atom.model_ops.context import AttentionContext, set_context
from atom.model_ops.sampler import Sampler, SamplingTensors, compute_logprobs
from atom.models.llama import head_dim_of

if TYPE_CHECKING:
    from atom.structured_output.manager import AdmissionResult
    from atom.structured_output.worker import StructuredOutputWorker

CPU_KV_CACHE_BYTES = 512 * 1024**2


@dataclass
class RunnerOutput:
    """Sampled token (and logprobs when asked) per sequence id that reached its end."""

    token_ids: dict[int, int]
    logprobs: dict[int, TokenLogprob]
    # Structured-output failures by sequence id: the request ends with finish_reason "error".
    errors: dict[int, str] = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, hf_config, rank: int = 0):
        self.config = config
        self.rank = rank
        self.model_path = model_path
        self.hf_config = hf_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = build_model(hf_config, model_path, self.dtype, self.device)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self._allocate_kv_cache(hf_config)
        self._structured_output: StructuredOutputWorker | None = None  # see `structured_output`

    def _allocate_kv_cache(self, hf_config) -> None:
        """Size the paged cache by bytes (CPU default 512 MiB) or a share of free GPU memory."""
        num_layers = hf_config.num_hidden_layers
        attn = self.model.model.layers[0].self_attn
        num_kv_heads, head_dim = attn.num_kv_heads, head_dim_of(hf_config)
        elem = torch.empty((), dtype=self.dtype).element_size()
        block_bytes = 2 * num_layers * self.block_size * num_kv_heads * head_dim * elem
        budget = self.config.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        elif budget is None:
            budget = CPU_KV_CACHE_BYTES
        self.num_blocks = budget // block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no {block_bytes}-byte block")
        shape = (2, num_layers, self.num_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]

    def kv_cache_info(self) -> dict:
        return {"num_blocks": self.num_blocks, "block_size": self.block_size}

    def describe(self) -> dict:
        return {"rank": self.rank, "device": str(self.device), "dtype": str(self.dtype)}

    @property
    def structured_output(self) -> StructuredOutputWorker:
        """This rank's structured-output owner, created (cheaply: its initialization runs in a
        background thread) by the first structured-output RPC; ordinary requests never do."""
        if self._structured_output is None:
            from atom.structured_output.worker import StructuredOutputWorker

            self._structured_output = StructuredOutputWorker(
                self.config, self.model_path, self.hf_config, self.model, self.device, self.rank
            )
        return self._structured_output

    @torch.inference_mode()
    def execute_model(self, batch: ScheduledBatch) -> RunnerOutput:
        for seq_id in batch.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if not batch.seqs:
            return RunnerOutput({}, {})
        input_ids, positions, rows = self._prepare_inputs(batch)
        hidden = self.model(input_ids, positions)
        grammar = self.structured_output if batch.has_constrained else None
        if grammar is not None and batch.grammar_updates:  # host work overlaps the forward
            grammar.commit(batch.grammar_updates)
        sample_seqs = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        if not sample_seqs:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        want = [s.params.logprobs for s in sample_seqs if s.params.logprobs is not None]
        raw_logprobs = logits.log_softmax(dim=-1) if want else None  # before any mask
        errors = grammar.mask_logits(logits, sample_seqs) if grammar is not None else {}
        token_ids = self.sampler(logits, self._sampling_tensors(sample_seqs))
        ids = token_ids.tolist()
        out = RunnerOutput(
            {s.seq_id: t for s, t in zip(sample_seqs, ids, strict=True) if s.seq_id not in errors},
            {},
            errors,
        )
        if raw_logprobs is not None:
            lp = compute_logprobs(raw_logprobs, token_ids, max(want))
            sampled, top_ids, top_lps = lp.sampled.tolist(), lp.top_ids.tolist(), lp.top.tolist()
            for i, s in enumerate(sample_seqs):
                k = s.params.logprobs
                if k is not None:
                    top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                    out.logprobs[s.seq_id] = TokenLogprob(ids[i], sampled[i], top)
        return out

    # ---- structured-output RPCs, answered by this rank's StructuredOutputWorker ---------------

    def structured_output_admit(
        self, spec: Any, api_fingerprint: str, vocab_size: int, wait_s: float = 0.0
    ) -> dict:
        return self.structured_output.admit(spec, api_fingerprint, vocab_size, wait_s)

    def structured_output_prepare(self, items: list[tuple[str, Any]]) -> dict[str, AdmissionResult]:
        return self.structured_output.prepare(items)

    def structured_output_release(self, request_ids: list[str]) -> None:
        if self._structured_output is not None:
            self._structured_output.release(request_ids)

    def structured_output_stats(self) -> dict:
        """Read by /metrics: without a worker yet, zeros (and nothing imported)."""
        if self._structured_output is None:
            return {"live_grammar_states": 0, "cached_grammars": 0}
        return self._structured_output.stats()

    def shutdown(self) -> None:
        if self._structured_output is not None:
            self._structured_output.shutdown()

    def _prepare_inputs(self, batch: ScheduledBatch):
        bs = self.block_size
        ids, pos, slots, ctx_lens, q_lens, rows = [], [], [], [], [], []
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = torch.zeros(len(batch.seqs), max_blocks, dtype=torch.long)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            p = torch.arange(start, start + n)
            table = torch.tensor(seq.block_table, dtype=torch.long)
            tables[i, : len(table)] = table
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            ctx_lens.append(start + n)
            q_lens.append(n)
            if batch.samples(i):
                rows.append(len(ids) - 1)
        dev = self.device
        q_lens_t = torch.tensor(q_lens)
        ctx = AttentionContext(
            slot_mapping=torch.cat(slots).to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True),
            context_lens=torch.tensor(ctx_lens).to(dev, non_blocking=True),
            query_lens=q_lens_t.to(dev, non_blocking=True),
            cu_seqlens_q=torch.nn.functional.pad(q_lens_t.cumsum(0), (1, 0)).to(dev),
            max_query_len=max(q_lens),
        )
        prepare_attention(ctx, bs)
        set_context(ctx)
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        positions = torch.cat(pos).to(dev, non_blocking=True)
        return input_ids, positions, torch.tensor(rows, dtype=torch.long, device=dev)

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        vocab = self.model.lm_head.org_vocab_size
        temps = [s.params.temperature for s in seqs]
        top_ks = [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs]
        top_ps = [s.params.top_p for s in seqs]
        dev = self.device
        return SamplingTensors(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_ks=torch.tensor(top_ks, device=dev) if any(k < vocab for k in top_ks) else None,
            top_ps=torch.tensor(top_ps, device=dev) if any(p < 1.0 for p in top_ps) else None,
            generators=[self._generator(s) for s in seqs],
        )

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A per-request RNG for seeded requests, kept across steps (and preemptions)."""
        if seq.params.seed is None:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.params.seed)
            self.generators[seq.seq_id] = gen
        return gen
