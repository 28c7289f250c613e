"""All engine and server configuration, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    # Path to an HF folder or a .gguf file; None means the embedded SmolLM2-135M-Instruct.
    model: str | None = None
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # defaults to the checkpoint's context, capped by the KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None  # explicit KV cache size; default: 512 MiB on CPU
    gpu_memory_utilization: float = 0.85  # share of free GPU memory for the KV cache on CUDA
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    seed: int = 0


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_adapter: str | None = None  # deployment adapter name (see entrypoints/deployments.py)
    log_level: str = "info"
