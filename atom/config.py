"""All engine and server configuration, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, get_args

# JSON whitespace allowed in constrained answers (the grammar enforces it; clients cannot change
# it): compact = none, space = at most one space, indent = at most one space or one newline plus
# up to 32 spaces, flexible = any run (llguidance's own). Measured: benchmarks/bench_whitespace.py
StructuredOutputWhitespace = Literal["compact", "space", "indent", "flexible"]
# Where speculative decoding's drafts come from (spec_decode/): n-gram lookup in the sequence
# itself, or a smaller draft model sharing the target's tokenizer.
SpeculativeMethod = Literal["ngram", "draft"]
MAX_GRAMMAR_THREADS = 16
# Cores per grammar process by default: one process's llguidance executor stops scaling at about
# 8 threads (H200 host, 256 integer-array rows: 15 threads took 1.6x what 7 took for 128 rows;
# two processes of 7 threads on disjoint cores took 1.76 ms beside each other, one of 15 took
# 3.05 ms: benchmarks/results/h200_2026-12-04d).
CORES_PER_GRAMMAR_PROCESS = 7


def available_cores() -> int:
    """The cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def default_grammar_threads() -> int:
    """The cores this process may use, capped: the mask fill of many requests stops scaling well
    before a large host's core count, and every rank fills its own masks."""
    return max(1, min(available_cores(), MAX_GRAMMAR_THREADS))


@dataclass
class EngineConfig:
    # Path to an HF folder or a .gguf file; None means the embedded SmolLM2-135M-Instruct.
    model: str | None = None
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    # A Hugging Face model id (`--model org/name`) is resolved through the local HF cache at this
    # revision (branch, tag or commit; default "main"), downloaded when the hub is reachable.
    revision: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # defaults to the checkpoint's context, capped by the KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None  # explicit KV cache size; default: 512 MiB on CPU
    # Share of the GPU's total memory this engine may use (weights + KV cache), as in vLLM.
    gpu_memory_utilization: float = 0.85
    # Ranks: one worker process per tensor-parallel rank (model_engine/multiproc_executor.py);
    # pipeline parallelism is not supported (refused).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Replicas: whole engines (scheduler + ranks) requests are spread over (llm_engine.py);
    # `data_parallel_rank` is set by the engine for each one (its ranks' devices follow it).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # The longest a rank may take to start or to answer one collective call (a step, an RPC)
    # before the engine is declared dead; a rank that exits is noticed at once.
    worker_timeout_s: float = 600.0
    # Nodes (README "Several nodes"): the tensor-parallel ranks split evenly over `nnodes` hosts,
    # each started with the same flags but its own `node_rank`. Node 0 runs the engine and ranks
    # [0, tp / nnodes); node k > 0 runs the next share headless. Every rank joins
    # torch.distributed at master_addr:master_port; node 0's engine takes the other nodes' ranks'
    # step connections on master_port + 1.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # How long the nodes wait for each other: a node k > 0 for node 0 to answer (then it exits
    # with an error), node 0 for the other nodes' ranks to connect (then its start fails).
    master_timeout_s: float = 120.0
    seed: int = 0
    # Run decode steps eagerly instead of replaying CUDA graphs (graphs are never used on CPU).
    enforce_eager: bool = False
    # Schedule and submit the next step before reading the previous one's output (see
    # model_engine/engine_core.py); off: read each step's output before scheduling the next.
    async_scheduling: bool = True
    structured_output_whitespace: StructuredOutputWhitespace = "space"
    # Threads of llguidance's executor, which fills the mask rows of many requests at once
    # (structured_output/manager.py; measured: benchmarks/bench_grammar_step.py).
    structured_output_threads: int = field(default_factory=default_grammar_threads)
    # Keep each rank's grammar states in a process of their own, whose per-row Python then runs
    # beside the engine thread's instead of contending for its GIL, and whose rows a CUDA stream
    # waits for without the engine thread waiting (structured_output/grammar_process.py,
    # grammar_board.py). None: on CUDA, off on CPU. Measured on the H200 (mostly-forbidden,
    # benchmarks/results/h200_2026-12-03j): enabled-request overhead 1.13/1.08/1.22 at batch
    # 16/64/256 with it, 1.60/1.84/1.83 without.
    structured_output_grammar_process: bool | None = None
    # How many grammar processes a rank splits its constrained requests over, each on its own
    # share of the cores (all of them for a step only one process has rows in;
    # structured_output/grammar_pool.py). None: one per
    # CORES_PER_GRAMMAR_PROCESS cores the engine thread leaves free (2 on a 16-core host), one
    # with speculative decoding, whose steps wait for one process's rows.
    structured_output_grammar_processes: int | None = None
    # Speculative decoding: up to `num_speculative_tokens` drafts per sequence and step, verified
    # by one target forward (model_ops/rejection_sampler.py). N-gram lookup keeps asynchronous
    # scheduling (drafts proposed a step ahead, positions corrected on the device); a draft model
    # schedules synchronously: its next drafts need the tokens this step accepted.
    speculative_method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 0
    speculative_model: str | None = None  # the draft model's folder (speculative_method "draft")

    def __post_init__(self) -> None:
        if self.structured_output_whitespace not in get_args(StructuredOutputWhitespace):
            raise ValueError(
                f"structured_output_whitespace must be one of "
                f"{get_args(StructuredOutputWhitespace)}, not {self.structured_output_whitespace!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        self._check_speculative()
        self._check_parallel()
        self._check_grammar_processes()

    def grammar_process(self, device_type: str) -> bool:
        """Whether ranks on ``device_type`` ("cuda", "cpu") keep their grammar states in a
        process of their own (``structured_output_grammar_process``; None: on CUDA only)."""
        if self.structured_output_grammar_process is None:
            return device_type == "cuda"
        return self.structured_output_grammar_process

    def grammar_processes(self, device_type: str) -> int:
        """How many grammar processes a rank on ``device_type`` starts (0: its states live in
        its own process)."""
        if not self.grammar_process(device_type):
            return 0
        if self.structured_output_grammar_processes is not None:
            return self.structured_output_grammar_processes
        if self.speculative_method is not None:
            return 1
        return max(1, (available_cores() - 1) // CORES_PER_GRAMMAR_PROCESS)

    def _check_grammar_processes(self) -> None:
        count = self.structured_output_grammar_processes
        if count is None:
            return
        if count < 1:
            raise ValueError("structured_output_grammar_processes must be at least 1")
        if count > 1 and self.speculative_method is not None:
            raise ValueError(
                "structured_output_grammar_processes: speculative decoding takes one grammar "
                f"process (got {count})"
            )

    def _check_parallel(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be at least 1")
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                "pipeline_parallel_size: pipeline parallelism is not supported "
                f"(got {self.pipeline_parallel_size}); use tensor_parallel_size"
            )
        if self.tensor_parallel_size > 1 and self.speculative_method is not None:
            raise ValueError("speculative decoding is not supported with tensor_parallel_size > 1")
        if self.worker_timeout_s <= 0:
            raise ValueError("worker_timeout_s must be positive")
        self._check_nodes()

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}"
            )
        if self.nnodes == 1:
            return
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} does not split evenly over "
                f"{self.nnodes} nodes"
            )
        if self.data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 is not supported with nnodes > 1")
        if not 0 < self.master_port < 65535 or self.master_timeout_s <= 0:
            raise ValueError("master_port must be in (0, 65535) and master_timeout_s positive")

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks each node runs (all of them on one node)."""
        return self.tensor_parallel_size // self.nnodes

    def _check_speculative(self) -> None:
        method = self.speculative_method
        if method is None:
            if self.num_speculative_tokens or self.speculative_model:
                raise ValueError("num_speculative_tokens and speculative_model need a method")
            return
        if method not in get_args(SpeculativeMethod):
            raise ValueError(f"speculative_method must be one of {get_args(SpeculativeMethod)}")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative decoding needs num_speculative_tokens >= 1")
        if (method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_model is the draft model of speculative_method 'draft'")
        if method == "draft":
            self.async_scheduling = False  # the draft model reads the tokens just accepted


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_adapter: str | None = None  # deployment adapter name (see entrypoints/deployments.py)
    # The tool-call format ("json-tags", "dsml"; see entrypoints/tool_parsers); None: the adapter's.
    tool_call_parser: str | None = None
    log_level: str = "info"
    # Worker processes for schema preparation and final answer validation, and the time budget
    # of one such call (an overrun fails that request alone; see structured_output/schema_workers).
    structured_output_processes: int = 2
    structured_output_budget_s: float = 10.0
    # Reliability and cross-site safety (entrypoints/openai/limits.py, drain.py).
    max_request_bytes: int = 8 << 20  # a larger body is a 413, refused while it is read
    # Host header values served (exact names, "*.suffix", or "*" for any); None: the loopback
    # names when bound to a loopback address, any otherwise.
    allowed_hosts: list[str] | None = None
    allowed_origins: list[str] | None = None  # CORS only when set ("*" for any origin)
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests may finish this long
    timeout_headers_s: float = 10.0  # a request's headers must arrive within this
    timeout_body_s: float = 30.0  # a request's body must arrive within this after its headers
    timeout_keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    timeout_write_s: float = 30.0  # a client reading nothing of its response this long is dropped
    max_connections: int = 1024  # open connections; one more gets a 503 and is closed
    # Required on /v1 routes when set (Bearer, or x-api-key on /v1/messages).
    api_key: str | None = None
    # A Jinja chat template file used instead of the tokenizer's own.
    chat_template: str | None = None
