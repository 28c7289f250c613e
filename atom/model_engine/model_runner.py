"""One rank's worker: owns the model and its KV cache, runs one scheduled batch per call.

inputs -> forward -> logits (ParallelLMHead) -> raw logprobs -> [grammar mask of constrained
target rows] -> sampler.
Every public method is callable by name through `Executor.collective_rpc`.

A batch with constrained requests hands its host grammar work (commit the acknowledged tokens,
fill the mask rows, queue the mask of its logits) to the structured-output worker's thread once
its forward is queued; its sampling is queued only after that work, when the next step is
submitted (once that step's inputs are built: building them, and the engine's reading of the
previous output, run while the grammar works) or when its own output is taken. So only the
sampling and the next forward's launch follow the grammar work on the host: the device runs
that forward right after this step's sampling.

With a grammar process (``EngineConfig.grammar_process``, CUDA by default) and no speculative
decoding, a constrained step goes to the grammar processes first, before its inputs are built
(``_send_gate``), so they fill its rows while this thread builds them and launches the forward;
its masking and sampling are then queued at once, behind a stream wait for those rows
(``_sample_gated``, ``structured_output.grammar_board``): the engine thread never waits for
grammar work, and reads the step's errors with its output.

On CUDA the forward of a decode step replays a CUDA graph (`cuda_graph.DecodeGraphs`, captured
at start-up unless `enforce_eager`); every other step, and every step on CPU, runs eagerly. The
host builds a step's inputs with one tensor per field (`step_inputs`) and reads the sampled ids
back once.

The bracketed step and the `structured_output_*` RPCs belong to this rank's
`StructuredOutputWorker`, created by the first of those RPCs; the runner only forwards to it, and
only for batches that carry constrained requests: an ordinary batch imports nothing of
`atom.structured_output`, allocates no mask buffer and loads no kernel.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from itertools import accumulate, compress
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from atom.config import EngineConfig
from atom.model_engine.cuda_graph import DecodeGraphs
from atom.model_engine.deferred_output import DeferredOutput, RunnerOutput, VerifiedOutput
from atom.model_engine.scheduler import GrammarUpdate, ScheduledBatch
from atom.model_engine.sequence import PLACEHOLDER, Sequence
from atom.model_engine.step_inputs import StepInputs, StepInputsBuilder
from atom.model_loader.weights import build_model
from atom.model_ops.attention import prepare_attention
from atom.model_ops.context import AttentionContext, set_context
from atom.model_ops.penalties import PenaltyTensors, apply_penalties, build_penalties
from atom.model_ops.penalties import to_device as penalties_to_device
from atom.model_ops.sampler import Sampler, SamplingTensors, compute_logprobs
from atom.models.llama import head_dim_of
from atom.spec_decode.speculator import Speculator

if TYPE_CHECKING:
    from atom.structured_output.manager import AdmissionResult
    from atom.structured_output.worker import GateCommit, StructuredOutputWorker

CPU_KV_CACHE_BYTES = 512 * 1024**2


class _Staged(NamedTuple):
    """A step's inputs before its forward: host tensors, the CUDA graph sizes that replay it
    (decode, verification; None: eager), whether the decode graph's buffers hold all but its
    ids already, and on the device its sampling rows and input ids (placeholders not filled)."""

    step: StepInputs
    size: int | None
    on_graph: bool
    verify: int | None
    rows: torch.Tensor
    input_ids: torch.Tensor


@dataclass
class _SampleRows:
    """The sequences that sample in a step, in row order, and what their parameters ask of it.
    A step whose sampling sequences are the previous step's (a batch that keeps decoding) uses
    the previous step's object as it is, its sampling tensors included (`_sample_rows`)."""

    seqs: list[Sequence]
    seq_ids: list[int]
    want: list[int | None]  # logprobs asked, per row
    logprobs: bool  # any row asks for logprobs
    penalized: bool  # any row has a repetition, frequency or presence penalty
    sampling: SamplingTensors | None = None  # built on first use


@dataclass
class _Unsampled:
    """A submitted step up to its logits: the sequences that sample, their logits, raw
    logprobs where asked, and the grammar work masking those logits, if any."""

    rows: _SampleRows
    logits: torch.Tensor | None
    raw_logprobs: torch.Tensor | None
    masking: Future | None = None  # the grammar work masking `logits`; its result: errors
    drafts: list[list[int]] | None = None  # per sequence, when the step verifies drafts


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def kv_budget_of_total(free: int, total: int, utilization: float) -> int:
    """vLLM's meaning of --gpu-memory-utilization: this process may use that share of the
    GPU's total memory; the KV cache gets what of it is not in use yet (weights, other
    processes). Raises when nothing is left."""
    in_use = total - free
    budget = int(total * utilization) - in_use
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} allows {int(total * utilization)} bytes, but "
            f"{in_use} are already in use: nothing is left for the KV cache"
        )
    return budget


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, hf_config, rank: int = 0):
        self.config = config
        self.rank = rank
        self.model_path = model_path
        self.hf_config = hf_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.step_inputs = StepInputsBuilder(config.block_size)  # kept from step to step
        torch.manual_seed(config.seed)
        self.model = build_model(hf_config, model_path, self.dtype, self.device)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self.speculator: Speculator | None = None
        if config.speculative_method:
            vocab = self.model.lm_head.org_vocab_size
            self.speculator = Speculator(config, self.dtype, self.device, vocab)
        self._allocate_kv_cache(hf_config)
        self.graphs = self._capture_graphs(hf_config)
        self.verify_graphs = self._capture_graphs(hf_config, 1 + config.num_speculative_tokens)
        self._submitted: deque[DeferredOutput | VerifiedOutput] = deque()  # not taken yet
        self._sampled_in: dict[int, DeferredOutput] = {}  # seq id -> its latest sampling step
        self._unsampled: _Unsampled | None = None  # submitted, sampling waits for grammar rows
        self._last_sample_rows: _SampleRows | None = None
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._structured_output: StructuredOutputWorker | None = None  # see `structured_output`
        if self.device.type == "cuda":
            # The host side of a GPU step is Python and small copies: torch's intra-op threads
            # only compete with the engine and grammar
            # threads (benchmarks/profile_step.py, H200,
            # batch 256: 3.4 ms per decode step with one thread, 5.0 ms with 16).
            torch.set_num_threads(1)

    def _allocate_kv_cache(self, hf_config) -> None:
        """Size the paged cache by bytes (CPU default 512 MiB) or, on CUDA, by what remains of
        the given share of total GPU memory once the weights (and all else in use) are loaded."""
        num_layers = hf_config.num_hidden_layers
        attn = self.model.model.layers[0].self_attn
        num_kv_heads, head_dim = attn.num_kv_heads, head_dim_of(hf_config)
        elem = torch.empty((), dtype=self.dtype).element_size()
        block_bytes = 2 * num_layers * self.block_size * num_kv_heads * head_dim * elem
        if self.speculator is not None:  # a draft model's cache has as many blocks
            block_bytes += self.speculator.block_bytes(self.block_size)
        budget = self.config.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_budget_of_total(free, total, self.config.gpu_memory_utilization)
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
        if self.speculator is not None:
            self.speculator.allocate_cache(self.num_blocks, self.block_size)

    def _capture_graphs(self, hf_config, query_len: int = 1) -> DecodeGraphs | None:
        """Decode CUDA graphs (`query_len` 1) or verification graphs (1 + drafts, with
        speculative decoding only) over the allocated KV cache; none on CPU (no launch overhead
        worth it) or with `enforce_eager`. Block tables are as wide as `max_model_len` needs,
        which the engine later caps to the same value (the checkpoint's context or the cache)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if query_len > 1 and self.speculator is None:
            return None
        capacity = self.num_blocks * self.block_size
        max_len = self.config.max_model_len or min(hf_config.max_position_embeddings, capacity)
        max_blocks = -(-max_len // self.block_size)
        max_num_seqs = self.config.max_num_seqs
        graphs = DecodeGraphs(self.model, max_num_seqs, max_blocks, self.device, query_len)
        graphs.capture()
        if query_len > 1 and self.speculator is not None:  # the draft model's decode steps
            self.speculator.capture_graphs(max_num_seqs, max_blocks, query_len)
        return graphs

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

    # ---- steps: submitted in order, their outputs taken in order -------------------------------

    def submit_model(self, batch: ScheduledBatch) -> None:
        """Queue one step's forward and sampling on the device without reading its output (see
        `deferred_output`); `take_output` returns it later. A step with constrained requests
        queues its sampling once its grammar rows are filled: when the next step is submitted,
        or its own output taken (`_queue_sampling`)."""
        step = self._execute(batch)
        if isinstance(step, _Unsampled):
            self._unsampled = step
        else:
            self._submitted.append(step)

    @torch.inference_mode()
    def _queue_sampling(self) -> None:
        """Queue the sampling of the newest submitted step if it waits for its grammar work
        (rows filled and logits masked on the grammar thread meanwhile; this waits for it)."""
        step, self._unsampled = self._unsampled, None
        if step is None:
            return
        try:
            errors = self.structured_output.finish_step(step.masking)
        except Exception as e:  # noqa: BLE001 - the step's constrained requests fail, not the rest
            errors = {
                s.seq_id: f"structured output: grammar step failed: {e!r}"
                for s in step.rows.seqs
                if s.params.structured_output is not None
            }
        self._submitted.append(self._sample(step, errors))

    def take_output(self) -> RunnerOutput:
        """The output of the oldest submitted step not taken yet (waits for its host copy). A
        step still waiting for its grammar rows is the newest: it is completed only when its
        own output is the one taken, so reading an older one never waits for those rows."""
        if not self._submitted:
            self._queue_sampling()
        return self._submitted.popleft().result()

    def output_ready(self) -> bool:
        """Has the oldest submitted step's host copy finished? (A step still waiting for its
        grammar rows, or none submitted: True, nothing to wait for here.)"""
        return not self._submitted or self._submitted[0].ready()

    def execute_model(self, batch: ScheduledBatch) -> RunnerOutput:
        """Submit one step and read its output at once (synchronous scheduling)."""
        self.submit_model(batch)
        return self.take_output()

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch) -> DeferredOutput | _Unsampled:
        sampled = self._sample_rows(batch)
        sample_seqs = sampled.seqs
        gate = self._send_gate(batch, sample_seqs)
        staged = self._stage(batch) if batch.seqs else None
        self._queue_sampling()  # the previous step's, which this one's inputs may read
        for seq_id in batch.finished_seq_ids:
            self.generators.pop(seq_id, None)
            self._sampled_in.pop(seq_id, None)
        if self.speculator is not None and batch.finished_seq_ids:
            self.speculator.release(batch.finished_seq_ids)
        if staged is None:
            return DeferredOutput.empty()
        hidden, rows = self._forward(staged)
        logits = self.model.compute_logits(hidden.index_select(0, rows)) if sample_seqs else None
        raw_logprobs = None
        if logits is not None and sampled.logprobs:
            raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        if logits is not None and sampled.penalized:
            apply_penalties(logits, self._penalties(sample_seqs, logits.shape[1]))
        step = _Unsampled(sampled, logits, raw_logprobs)
        if batch.has_drafts:
            step.drafts = list(compress(batch.draft_token_ids, batch.sampling))
        if not batch.has_constrained:
            return self._sample(step, {})
        if gate is not None:
            return self._sample_gated(gate, step)
        step.masking = self.structured_output.start_step(
            self._grammar_updates(batch), sample_seqs, logits, step.drafts
        )
        return step

    def _sample(self, step: _Unsampled, errors: dict[int, str]) -> DeferredOutput | VerifiedOutput:
        """Queue the sampling (or, with drafts, the verification) of a step whose logits are
        masked where constrained."""
        if step.logits is None:
            return DeferredOutput.empty()
        rows = step.rows
        if rows.sampling is None:
            rows.sampling = self._sampling_tensors(rows.seqs)
        if step.drafts is not None:
            assert self.speculator is not None
            verified = self.speculator.verify(
                step.logits, rows.seqs, step.drafts, rows.sampling, errors, self.copy_stream
            )
            for seq_id in rows.seq_ids:
                self._sampled_in[seq_id] = verified
            return verified
        token_ids = self.sampler(step.logits, rows.sampling)
        logprobs = None
        if step.raw_logprobs is not None:
            num_top = max(k for k in rows.want if k is not None)
            logprobs = compute_logprobs(step.raw_logprobs, token_ids, num_top)
        seq_ids = rows.seq_ids
        out = DeferredOutput(seq_ids, token_ids, errors, logprobs, rows.want, self.copy_stream)
        for seq_id in seq_ids:
            self._sampled_in[seq_id] = out
        return out

    def _sample_rows(self, batch: ScheduledBatch) -> _SampleRows:
        """The batch's sampling sequences and what they ask (see `_SampleRows`): the previous
        step's when they are the same objects in the same order (their parameters never
        change), which spares a batch that keeps decoding a pass over every sequence's
        parameters and the copies of its sampling tensors."""
        seqs = list(compress(batch.seqs, batch.sampling))
        last = self._last_sample_rows
        if last is not None and last.seqs == seqs:
            return last
        seq_ids = [s.seq_id for s in seqs]
        if last is not None and last.seq_ids == seq_ids:
            # A rank process rebuilds its sequences every step (``step_transport``), each with
            # the parameters object it keeps for that sequence id.
            self._last_sample_rows = replace(last, seqs=seqs)
            return self._last_sample_rows
        want = [s.params.logprobs for s in seqs]
        self._last_sample_rows = _SampleRows(
            seqs,
            seq_ids,
            want,
            any(k is not None for k in want),
            any(s.params.penalized for s in seqs),
        )
        return self._last_sample_rows

    def _send_gate(self, batch: ScheduledBatch, sample_seqs: list[Sequence]) -> int | None:
        """A constrained step that samples, with a grammar process: its grammar work goes to the
        children now, before its inputs are built and its forward launched, so they fill its
        rows meanwhile (``_sample_gated`` masks with them); its gate, else None."""
        if not (batch.has_constrained and sample_seqs and self.structured_output.gates):
            return None
        self._queue_sampling()  # a step without a gate commits first, in order
        worker = self.structured_output
        if not batch.grammar_updates:
            if worker.repeats_last_gate(sample_seqs, len(batch.grammar_placeholders)):
                return worker.repeat_gate()
        return worker.gate_send(self._gate_commits(batch), sample_seqs)

    def _sample_gated(self, gate: int, step: _Unsampled) -> DeferredOutput:
        """A constrained step with a grammar process: its masking and sampling are queued now,
        behind a wait for the children's rows (``grammar_board``); its sampled ids go to the
        board for the next step's commits, and its errors are read with its output."""
        worker = self.structured_output
        worker.gate_mask(gate, step.logits)
        out = self._sample(step, {})
        assert isinstance(out, DeferredOutput)
        worker.publish(gate, out.token_ids)
        out.gate = gate
        out.pending_errors = partial(worker.gate_errors, gate)
        return out

    def _gate_commits(self, batch: ScheduledBatch) -> list[GateCommit]:
        """The batch's grammar updates for a gate: a placeholder's source is the ring row of the
        gate that sampled it, counted back from the next gate (a step sampled without a gate is
        read here, waiting for it). Runs on a constrained step that does not repeat the last
        gate (``StructuredOutputWorker.repeats_last_gate``), once per constrained request."""
        next_gate, sampled_in = self.structured_output.next_gate, self._sampled_in
        commits: list[GateCommit] = []
        for u in batch.all_grammar_updates():
            tokens = u.new_token_ids  # the scheduler's own slice: nothing else holds it
            if PLACEHOLDER not in tokens:
                commits.append((u.request_id, tokens, None))
                continue
            out = sampled_in[u.seq_id]
            if isinstance(out, DeferredOutput) and out.gate is not None:
                commits.append((u.request_id, tokens, (next_gate - out.gate, out.rows[u.seq_id])))
            else:
                sampled = out.tokens_of(u.seq_id)
                tokens = [x for t in tokens for x in (sampled if t == PLACEHOLDER else (t,))]
                commits.append((u.request_id, tokens, None))
        return commits

    def _grammar_updates(self, batch: ScheduledBatch) -> Callable[[], list[GrammarUpdate]]:
        """The batch's grammar updates as a function for the grammar thread: there each
        placeholder becomes the token this rank sampled for it, read from its step's host copy
        (which may wait for that copy, on that thread). The steps are looked up here, now."""
        known: list[tuple[GrammarUpdate, DeferredOutput | VerifiedOutput | None]] = []
        for u in batch.all_grammar_updates():
            source = None
            if PLACEHOLDER in u.new_token_ids:
                source = self._sampled_in[u.seq_id]
            known.append((u, source))

        def resolve() -> list[GrammarUpdate]:
            updates = []
            for u, source in known:
                if source is not None:
                    sampled = source.tokens_of(u.seq_id)
                    tokens = [
                        x for t in u.new_token_ids for x in (sampled if t == PLACEHOLDER else (t,))
                    ]
                    u = GrammarUpdate(u.request_id, tokens, u.seq_id)
                updates.append(u)
            return updates

        return resolve

    def propose_drafts(
        self,
        seqs: list[Sequence],
        max_drafts: list[int],
        in_flight: list[list[int]] | None = None,
    ) -> dict[int, list[int]]:
        """Speculative decoding: each sequence's drafts for its next step, by sequence id
        (`in_flight`: asynchronous scheduling, see `Speculator.propose`)."""
        assert self.speculator is not None
        return self.speculator.propose(seqs, max_drafts, in_flight)

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

    def _stage(self, batch: ScheduledBatch) -> _Staged:
        """The step's inputs built on the host, their ids and sampling rows queued to the
        device; nothing here reads an earlier step's output."""
        n = len(batch.seqs)
        size = None
        if self.graphs is not None and max(batch.num_new_tokens) == 1:
            size = self.graphs.padded_size(n)
        pin = self.device.type == "cuda"
        step = self.step_inputs.build(batch, size or n, pin)
        # A decode graph's buffers take all but the ids now, unless a verification in flight
        # may still move its sequences (`_shift_rows`: speculative decoding).
        on_graph = size is not None and self.speculator is None
        if on_graph:
            self.graphs.stage(
                step.positions, step.slot_mapping, step.context_lens, step.block_tables
            )
        return _Staged(
            step,
            size,
            on_graph,
            self._verify_size(batch),
            step.sample_rows.to(self.device, non_blocking=True),
            step.input_ids.to(self.device, non_blocking=True),
        )

    def _forward(self, staged: _Staged) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step's rows (padding rows included for a graph) and, on the
        device, the rows whose sequences sample. A decode step replays a CUDA graph when there
        is one for its batch; prefill, chunked-prefill and mixed steps run eagerly."""
        step, size, on_graph, verify, rows, input_ids = staged
        self._fill_placeholders(input_ids, step)  # may move some of `step` to the device
        if on_graph:
            return self.graphs.launch(input_ids, size), rows
        if size is not None:
            return self.graphs.replay(step, input_ids), rows
        if verify is not None:
            cu_seqlens_q = self._to_device(
                list(accumulate(step.query_lens, initial=0)), torch.int32
            )
            hidden = self.verify_graphs.replay_packed(
                input_ids,
                step.positions,
                step.slot_mapping,
                step.context_lens,
                step.block_tables,
                cu_seqlens_q,
                verify,
            )
            return hidden, rows
        return self._run_eager(step, input_ids), rows

    def _verify_size(self, batch: ScheduledBatch) -> int | None:
        """The verification graph that replays `batch`, if it is one: every sequence decodes
        its last token and its drafts (no prefill chunk in the step)."""
        if self.verify_graphs is None or not batch.has_drafts:
            return None
        for n, drafts in zip(batch.num_new_tokens, batch.draft_token_ids, strict=True):
            if n != 1 + len(drafts):
                return None
        return self.verify_graphs.padded_size(len(batch.seqs))

    def _fill_placeholders(self, input_ids: torch.Tensor, step: StepInputs) -> None:
        """Inputs the host has not read yet: each is copied on the device from the step that
        sampled it, at rows the host knows (no device-to-host read). A verification's
        sequences also move on the device by the drafts it accepted (`_shift_rows`)."""
        seq_ids = step.placeholder_seq_ids
        outs = [self._sampled_in[seq_id] for seq_id in seq_ids]
        dst = step.placeholder_rows
        if outs and outs.count(outs[0]) == len(outs):  # one step sampled all
            out = outs[0]
            # The common decode step: that step sampled exactly these sequences, in this order,
            # and their inputs are rows 0..k-1 (ascending: the last row tells).
            if type(out) is DeferredOutput and out.seq_ids == seq_ids and dst[-1] == len(dst) - 1:
                input_ids[: len(dst)].copy_(out.next_input_ids)
                return
            groups = [(out, dst, seq_ids, step.placeholder_seqs)]
        else:
            groups = _group_by_output(outs, step)
        for out, dst, ids, owners in groups:
            src = list(map(out.rows.__getitem__, ids))
            src_rows, dst_rows = self._to_device(src + dst, torch.long).split(len(src))
            tokens = out.next_input_ids.index_select(0, src_rows)
            input_ids.index_copy_(0, dst_rows, tokens)
            if isinstance(out, VerifiedOutput):
                self._shift_rows(step, owners, out.num_accepted.index_select(0, src_rows))

    def _shift_rows(self, step: StepInputs, owners: list[int], shift: torch.Tensor) -> None:
        """Asynchronous speculative decoding: the host placed sequences `owners` (batch indices)
        as if the verification in flight had accepted none of their drafts; on the device each
        moves `shift` positions on (the drafts it did accept), with its KV slots and context
        length. The host reserved blocks for every draft accepted (`Scheduler`)."""
        rows, row_owner = [], []  # the rows of those sequences, and the index in `owners` of each
        starts = list(accumulate(step.query_lens, initial=0))
        for k, b in enumerate(owners):
            rows += range(starts[b], starts[b + 1])
            row_owner += [k] * step.query_lens[b]
        dev, bs = self.device, self.block_size
        index = self._to_device(rows + row_owner + owners, torch.long).split(
            [len(rows), len(rows), len(owners)]
        )
        rows_d, row_owner_d, owners_d = index
        positions = step.positions.to(dev, non_blocking=True, copy=True)
        positions.index_add_(0, rows_d, shift.index_select(0, row_owner_d))
        context_lens = step.context_lens.to(dev, non_blocking=True, copy=True)
        context_lens.index_add_(0, owners_d, shift.to(torch.int32))
        tables = step.block_tables.to(dev, non_blocking=True)
        moved = positions.index_select(0, rows_d)
        blocks = tables[owners_d.index_select(0, row_owner_d), moved // bs].long()
        slots = step.slot_mapping.to(dev, non_blocking=True, copy=True)
        slots.index_copy_(0, rows_d, blocks * bs + moved % bs)
        step.positions, step.context_lens = positions, context_lens
        step.slot_mapping, step.block_tables = slots, tables

    def _run_eager(self, step: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        dev = self.device
        q_lens = step.query_lens
        ctx = AttentionContext(
            slot_mapping=step.slot_mapping.to(dev, non_blocking=True),
            block_tables=step.block_tables.to(dev, non_blocking=True),
            context_lens=step.context_lens.to(dev, non_blocking=True),
            query_lens=self._to_device(q_lens, torch.long),
            cu_seqlens_q=self._to_device(list(accumulate(q_lens, initial=0)), torch.long),
            max_query_len=max(q_lens),
        )
        prepare_attention(ctx, self.block_size)
        set_context(ctx)
        return self.model(input_ids, step.positions.to(dev, non_blocking=True))

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """One host list as a device tensor, through pinned memory on CUDA (no host wait)."""
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        temps = [s.params.temperature for s in seqs]
        if not any(temps):  # all greedy: the sampler needs no tensor and no RNG
            return SamplingTensors(None, None, None, [None] * len(seqs))
        vocab = self.model.lm_head.org_vocab_size
        top_ks = [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs]
        top_ps = [s.params.top_p for s in seqs]
        min_ps = [s.params.min_p for s in seqs]
        return SamplingTensors(
            temperatures=self._to_device(temps, torch.float32),
            top_ks=self._to_device(top_ks, torch.long) if any(k < vocab for k in top_ks) else None,
            top_ps=self._to_device(top_ps, torch.float32) if any(p < 1 for p in top_ps) else None,
            generators=[self._generator(s) for s in seqs],
            min_ps=self._to_device(min_ps, torch.float32) if any(min_ps) else None,
        )

    def _penalties(self, seqs: list[Sequence], vocab: int) -> PenaltyTensors:
        """The penalized rows' settings and token history. A row's last token is this step's
        placeholder; an output token before it that the host has not read yet is taken on the
        device from the step that sampled it (as `_fill_placeholders` does for inputs)."""
        rows = [i for i, s in enumerate(seqs) if s.params.penalized]
        chosen = [seqs[i] for i in rows]
        outputs = [s.token_ids[s.num_prompt_tokens : len(s.token_ids) - 1] for s in chosen]
        prompts = [s.prompt_token_ids for s in chosen]
        host = build_penalties(rows, [s.params for s in chosen], outputs, prompts, vocab)
        t = penalties_to_device(host, self.device)
        for r, (seq, out) in enumerate(zip(chosen, outputs, strict=True)):
            holes = [c for c, token in enumerate(out) if token == PLACEHOLDER]
            if holes:
                source = self._sampled_in[seq.seq_id]
                token = source.token_ids[source.rows[seq.seq_id]]
                t.output_ids[r, holes] = token
        return t

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


def _group_by_output(
    outs: list[DeferredOutput | VerifiedOutput], step: StepInputs
) -> list[tuple[DeferredOutput | VerifiedOutput, list[int], list[int], list[int]]]:
    """The placeholders of `step` by the step that sampled them (`outs`, one per placeholder):
    per step, its destination rows, sequence ids and batch indices."""
    groups: dict[int, tuple[DeferredOutput | VerifiedOutput, list[int], list[int], list[int]]] = {}
    for out, row, seq_id, index in zip(
        outs, step.placeholder_rows, step.placeholder_seq_ids, step.placeholder_seqs, strict=True
    ):
        _, dst, ids, owners = groups.setdefault(id(out), (out, [], [], []))
        dst.append(row)
        ids.append(seq_id)
        owners.append(index)
    return list(groups.values())
