"""One rank's worker: owns the model and its KV cache, runs one scheduled batch per call.

inputs -> forward -> [commit acknowledged grammar tokens] -> logits (ParallelLMHead) -> raw
logprobs -> [grammar mask of constrained target rows] -> sampler.
Every public method is callable by name through `Executor.collective_rpc`.

Structured output (bracketed steps) is initialized on the first admission RPC, in a background
thread, and touched only by batches that carry constrained requests: an ordinary batch imports
nothing of `atom.structured_output`, allocates no mask buffer and loads no kernel.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from atom.config import EngineConfig
from atom.model_engine.output import TokenLogprob
from atom.model_engine.scheduler import GrammarUpdate, ScheduledBatch
from atom.model_engine.sequence import Sequence
from atom.model_loader.weights import build_model
from atom.model_ops.attention import prepare_attention
from atom.model_ops.context import AttentionContext, set_context
from atom.model_ops.embed_head import ParallelLMHead
from atom.model_ops.sampler import Sampler, SamplingTensors, compute_logprobs
from atom.models.llama import head_dim_of

logger = logging.getLogger(__name__)

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
        # Structured output, all lazy (see the module docstring).
        self._so_manager: Any = None
        self._so_init: threading.Thread | None = None
        self._so_init_error: str | None = None
        self._mask_buffers: Any = None

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

    @torch.inference_mode()
    def execute_model(self, batch: ScheduledBatch) -> RunnerOutput:
        for seq_id in batch.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if not batch.seqs:
            return RunnerOutput({}, {})
        input_ids, positions, rows = self._prepare_inputs(batch)
        hidden = self.model(input_ids, positions)
        if batch.grammar_updates:  # after submitting the forward: host work overlaps it on GPU
            self._grammar_sync(batch.grammar_updates)
        sample_seqs = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        if not sample_seqs:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        want = [s.params.logprobs for s in sample_seqs if s.params.logprobs is not None]
        raw_logprobs = logits.log_softmax(dim=-1) if want else None  # before any mask
        errors = self.apply_logits_mask(logits, sample_seqs)
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

    def apply_logits_mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, str]:
        """Grammar-mask the constrained rows of `logits` in place (after raw logprobs were taken,
        before sampling). Returns structured-output errors by sequence id; those requests end
        with "error" and their sampled token is dropped. A no-op for ordinary batches."""
        rows = [i for i, s in enumerate(seqs) if s.params.structured_output is not None]
        if not rows:
            return {}
        mgr = self._so_manager
        errors: dict[int, str] = {}
        live: list[tuple[str, tuple]] = []
        live_rows: list[int] = []
        for i in rows:
            seq = seqs[i]
            state = mgr.state(seq.request_id) if mgr is not None else None
            message = None
            if state is None:
                message = "structured output: this request has no grammar state on this rank"
            if message is None and state.error is not None:
                message = state.error
            if message is not None:
                errors[seq.seq_id] = message
                continue
            live.append((seq.request_id, ()))
            live_rows.append(i)
        if not live:
            return errors
        if self._mask_buffers is None:
            from atom.structured_output.utils import MaskBuffers

            self._mask_buffers = MaskBuffers(logits.shape[1], self.device)
        host = self._mask_buffers.host_rows(len(live))
        mgr.fill_masks(host, live)
        for (rid, _), i in zip(live, live_rows, strict=True):
            error = mgr.error(rid)  # a matcher failure while masking: stop mask, then error
            if error is not None:
                errors[seqs[i].seq_id] = error
        self._mask_buffers.apply(logits, len(live), live_rows)
        return errors

    # ---- structured output (worker side) ------------------------------------------------------

    def structured_output_admit(
        self, spec: Any, api_fingerprint: str, vocab_size: int, wait_s: float = 0.0
    ) -> dict:
        """Admission RPC: check this rank can enforce `spec` and compile it in the background.

        Answers {"status": "ready" | "pending" | "error", "message", "rank"} without waiting for
        a compile (wait_s=0 from the API): the engine loop is never held by compilation.
        """
        from atom import envs

        def answer(status: str, message: str = "") -> dict:
            return {"status": status, "message": message, "rank": self.rank}

        if envs.enable_relaxed_mtp():
            return answer("error", "structured output is disabled with relaxed MTP")
        if not isinstance(getattr(self.model, "lm_head", None), ParallelLMHead):
            return answer("error", "the target LM head is not a ParallelLMHead")
        if self._so_init_error is not None:
            return answer("error", self._so_init_error)
        if self._so_manager is None:
            if self._so_init is None:
                self._so_init = threading.Thread(
                    target=self._init_structured_output, name="atom-grammar-init", daemon=True
                )
                self._so_init.start()
            return answer("pending")
        result = self._so_manager.admit(spec, api_fingerprint, vocab_size, wait_s)
        return answer(result.status, result.message)

    def _init_structured_output(self) -> None:
        """Background: this rank's tokenizer and grammar tokenizer (seconds for a big vocab)."""
        try:
            from atom.model_engine.llm_engine import _eos_ids, load_tokenizer
            from atom.structured_output.manager import StructuredOutputManager

            tokenizer = load_tokenizer(self.config.tokenizer or self.model_path)
            head = self.model.lm_head.org_vocab_size
            self._so_manager = StructuredOutputManager(
                tokenizer,
                vocab_size=head,
                lm_head_size=head,
                stop_token_ids=_eos_ids(self.hf_config, tokenizer),
                whitespace=self.config.structured_output_whitespace,
            )
        except Exception as e:  # noqa: BLE001 - every later admission reports it
            logger.exception("structured output initialization failed")
            self._so_init_error = f"structured output initialization failed: {e}"

    def _grammar_sync(self, updates: list[GrammarUpdate]) -> None:
        """Commit acknowledged tokens. Matchers were bound at submission
        (`structured_output_bind`), so nothing here compiles or binds; a request without a state
        on this rank is failed by `apply_logits_mask`."""
        mgr = self._so_manager
        if mgr is None:
            return
        for u in updates:
            if u.new_token_ids and mgr.state(u.request_id) is not None:
                mgr.commit(u.request_id, u.new_token_ids)  # a rejection marks only this request

    def structured_output_bind(self, items: list[tuple[str, Any]]) -> dict:
        """Submission RPC: give each `(request_id, spec)` its own matcher on this rank, all or
        none. Called by the engine core before the requests enter the scheduler.

        Never compiles on the calling thread (the engine loop): a grammar evicted from the
        compile cache since admission is recompiled in the background executor and answered
        "pending" with nothing bound, and the submitter polls. Answers
        {"status": "ok" | "pending" | "error", "message", "rank"}.
        """

        def answer(status: str, message: str = "") -> dict:
            return {"status": status, "message": message, "rank": self.rank}

        from atom.structured_output.manager import AdmissionResult

        mgr = self._so_manager
        if mgr is None:
            return answer(
                "error", self._so_init_error or "structured output: not initialized on this rank"
            )
        bound: list[str] = []
        status, message = "ok", ""
        for rid, spec in items:
            try:
                mgr.bind(rid, spec.key, spec.end_marker)
                bound.append(rid)
                continue
            except LookupError:
                pass  # evicted since admission (or never admitted on this rank)
            except ValueError as e:
                status, message = "error", f"structured output: {e}"
                break
            result = mgr.admit(spec, mgr.fingerprint, mgr.vocab_size)  # background, no wait
            if result.status == "ready":  # finished in between: binding is a deep copy
                try:
                    mgr.bind(rid, spec.key, spec.end_marker)
                    bound.append(rid)
                    continue
                except LookupError:  # evicted again: let the submitter poll
                    result = AdmissionResult("pending")
            status = result.status
            message = f"structured output: {result.message}" if result.message else ""
            break
        if status != "ok":
            for rid in bound:
                mgr.release(rid)
        return answer(status, message)

    def structured_output_release(self, request_ids: list[str]) -> None:
        """Drop these requests' grammar state; idempotent (every terminal path may call it)."""
        if self._so_manager is not None:
            for rid in request_ids:
                self._so_manager.release(rid)

    def structured_output_stats(self) -> dict:
        mgr = self._so_manager
        if mgr is None:
            return {"live_grammar_states": 0, "cached_grammars": 0}
        return {
            "live_grammar_states": mgr.num_live_states,
            "cached_grammars": mgr.num_cached_grammars,
        }

    def shutdown(self) -> None:
        if self._so_manager is not None:
            self._so_manager.shutdown()

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
