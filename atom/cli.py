"""`atom serve | generate | schema-check`: the command line. Heavy imports happen inside commands."""

from __future__ import annotations

import argparse
import sys
from typing import Any, get_args

from atom.config import EngineConfig, ServerConfig, SpeculativeMethod, StructuredOutputWhitespace


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="HF folder (config.json + safetensors + tokenizer), a .gguf file, or a Hugging Face "
        "model id (from the local HF cache, else downloaded); default: the embedded "
        "SmolLM2-135M-Instruct",
    )
    g.add_argument("--revision", default=None, help="revision of a Hugging Face model id")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: derived)"
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument(
        "--max-model-len", type=int, default=None, help="context length (prompt + output)"
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running requests")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens per step (prefill is chunked under it)",
    )
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="disable KV prefix caching by block hash"
    )
    g.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (CPU default 512 MiB)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="share of total GPU memory this engine may use; the KV cache gets what the weights "
        "leave of it (CUDA)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="engine seed")
    _add_parallel_args(g, d)
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs (graphs are CUDA only)",
    )
    g.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="read each step's output before scheduling the next (default: overlap them)",
    )
    _add_structured_output_args(g, d)
    g.add_argument(
        "--speculative-method",
        choices=get_args(SpeculativeMethod),
        default=None,
        help="speculative decoding: drafts from n-gram lookup in the sequence or from a draft "
        "model, verified by one target forward (a draft model schedules synchronously)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help="drafts per sequence and step",
    )
    g.add_argument(
        "--speculative-model",
        default=None,
        help="the draft model's folder (--speculative-method draft; same tokenizer as the model)",
    )


def _add_structured_output_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    g.add_argument(
        "--structured-output-whitespace",
        default=d.structured_output_whitespace,
        choices=get_args(StructuredOutputWhitespace),
        help="JSON whitespace allowed in constrained answers: none, one space, one space or a "
        "newline plus indentation, any run (default: %(default)s)",
    )
    g.add_argument(
        "--structured-output-grammar-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep each rank's grammar states in a process of their own (default: on CUDA, "
        "off on CPU; see README)",
    )
    g.add_argument(
        "--structured-output-grammar-processes",
        type=int,
        default=None,
        help="grammar processes per rank, each on its own share of the cores (default: one "
        "per 7 cores the engine thread leaves, one with speculative decoding)",
    )


def _add_parallel_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    ints = {
        "tensor_parallel_size": "ranks the model is sharded over (one worker process each)",
        "pipeline_parallel_size": "pipeline parallelism is not supported: only 1 is accepted",
        "data_parallel_size": "replicas of the engine, each with its own ranks (processes)",
        "nnodes": "hosts the tensor-parallel ranks are split over, evenly (README: Several nodes)",
        "node_rank": "this host's place: 0 runs the server and the first ranks, k > 0 only its "
        "share of the ranks (headless)",
        "master_port": "torch.distributed port on node 0; the next port takes the other nodes' "
        "ranks' step connections",
    }
    for name, text in ints.items():
        flag = "--" + name.replace("_", "-")
        g.add_argument(flag, type=int, default=getattr(d, name), help=text)
    g.add_argument(
        "--master-addr", default=d.master_addr, help="node 0's address, as the others reach it"
    )
    g.add_argument(
        "--master-timeout",
        type=_positive(float),
        default=d.master_timeout_s,
        help="seconds a node k > 0 tries to reach node 0 before it exits, and node 0 waits for "
        "the other nodes' ranks (default: %(default)s)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration; a refused combination exits with its one-line reason."""
    try:
        config = _engine_config(args)
        if config.nnodes > 1:  # the nodes' key rule, before anything loads
            from atom.model_engine.remote_ranks import bind_address

            bind_address(config)
        return config
    except ValueError as e:
        raise SystemExit(f"atom: error: {e}") from None


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        revision=args.revision,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        master_timeout_s=args.master_timeout,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        structured_output_whitespace=args.structured_output_whitespace,
        structured_output_grammar_process=args.structured_output_grammar_process,
        structured_output_grammar_processes=args.structured_output_grammar_processes,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible HTTP server")
    _add_engine_args(serve)
    s = ServerConfig()
    serve.add_argument("--host", default=s.host, help="listening address")
    serve.add_argument("--port", type=int, default=s.port, help="listening port")
    serve.add_argument(
        "--model-adapter",
        default=None,
        help="deployment adapter advertised on /v1/models (default: derived from the checkpoint)",
    )
    serve.add_argument("--log-level", default=s.log_level, help="uvicorn log level")
    serve.add_argument(
        "--tool-call-parser",
        choices=("json-tags", "dsml"),
        default=None,
        help="the tool-call format the model writes (default: the deployment adapter's)",
    )
    serve.add_argument(
        "--chat-template", default=None, help="Jinja chat template file (default: the tokenizer's)"
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key on /v1 routes (Authorization: Bearer; x-api-key on /v1/messages)",
    )
    serve.add_argument(
        "--structured-output-processes",
        type=_positive(int),
        default=s.structured_output_processes,
        help="worker processes for schema preparation and final answer validation",
    )
    serve.add_argument(
        "--structured-output-budget",
        type=_positive(float),
        default=s.structured_output_budget_s,
        help="seconds one schema preparation or final validation may take before that request "
        "fails (default: %(default)s)",
    )

    _add_limit_args(serve, s)

    gen = sub.add_parser("generate", help="generate a completion for one prompt (offline)")
    _add_engine_args(gen)
    gen.add_argument("prompt", help="user message (the chat template is applied)")
    gen.add_argument("--max-tokens", type=int, default=64, help="output token cap")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")

    check = sub.add_parser("schema-check", help="check JSON Schemas against the grammar compiler")
    check.add_argument("files", nargs="+", help="JSON Schema files")
    check.add_argument("--tokenizer", default=None, help="tokenizer (default: embedded SmolLM2)")
    check.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser


def _add_limit_args(p: argparse.ArgumentParser, s: ServerConfig) -> None:
    g = p.add_argument_group("limits and safety")
    g.add_argument(
        "--max-request-bytes",
        type=_positive(int),
        default=s.max_request_bytes,
        help="largest request body; a larger one is a 413 (default: %(default)s)",
    )
    g.add_argument(
        "--allowed-hosts",
        type=_names,
        default=None,
        help="Host header names served, comma-separated or a JSON list ('*': any; default: the "
        "loopback names when bound to a loopback address, any otherwise)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_names,
        default=None,
        help="web origins allowed cross-site (CORS), comma-separated or a JSON list ('*': any; "
        "default: none, no CORS)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=_non_negative,
        default=s.shutdown_timeout_s,
        help="on SIGTERM, seconds in-flight requests may finish before they are ended with an "
        "error event (default: %(default)s)",
    )
    g.add_argument(
        "--timeout-headers",
        type=_positive(float),
        default=s.timeout_headers_s,
        help="seconds a client may take to send a request's headers (default: %(default)s)",
    )
    g.add_argument(
        "--timeout-body",
        type=_positive(float),
        default=s.timeout_body_s,
        help="seconds a client may take to send a request's body (default: %(default)s)",
    )
    g.add_argument(
        "--timeout-write",
        type=_positive(float),
        default=s.timeout_write_s,
        help="seconds a client may read nothing of a response (a stream it stopped reading) "
        "before it is dropped and its request aborted (default: %(default)s)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=_positive(float),
        default=s.timeout_keep_alive_s,
        help="seconds an idle keep-alive connection stays open (default: %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=_non_negative_int,
        default=s.max_connections,
        help="open connections at most; one more gets a 503 (0: no cap; default: %(default)s)",
    )


def _names(text: str) -> list[str]:
    """A JSON list of strings (as vLLM takes them) or comma-separated names."""
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return names
    return [n.strip() for n in text.split(",") if n.strip()]


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` above zero."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value

    return parse


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        model_adapter=args.model_adapter,
        tool_call_parser=args.tool_call_parser,
        log_level=args.log_level,
        structured_output_processes=args.structured_output_processes,
        structured_output_budget_s=args.structured_output_budget,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
        shutdown_timeout_s=args.shutdown_timeout,
        timeout_headers_s=args.timeout_headers,
        timeout_body_s=args.timeout_body,
        timeout_keep_alive_s=args.timeout_keep_alive,
        timeout_write_s=args.timeout_write,
        max_connections=args.max_connections,
        api_key=args.api_key,
        chat_template=args.chat_template,
    )


def _run_node(config: EngineConfig, log_level: str) -> int:
    """A node k > 0 (serve or generate alike): its ranks only, headless, driven by node 0."""
    import logging

    from atom.model_engine.remote_ranks import run_node

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO))
    return run_node(config)


def _serve(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    if config.node_rank > 0:
        return _run_node(config, args.log_level)
    from atom.entrypoints.openai.api_server import run_server

    return run_server(config, server_config_from_args(args))


def _generate(args: argparse.Namespace) -> int:
    from atom.llm import LLM
    from atom.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    if config.node_rank > 0:
        return _run_node(config, "info")
    llm = LLM(config=config)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.raw:
        out = llm.generate([args.prompt], params)[0]
    else:
        out = llm.chat([[{"role": "user", "content": args.prompt}]], params)[0]
    print(out.text)
    return 0


def _schema_check(args: argparse.Namespace) -> int:
    from atom.structured_output.schema_check import run_schema_check

    return run_schema_check(args.files, tokenizer=args.tokenizer, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    from atom.model_loader import ModelLoadError

    args = build_parser().parse_args(argv)
    handlers = {"serve": _serve, "generate": _generate, "schema-check": _schema_check}
    try:
        return handlers[args.command](args)
    except ModelLoadError as e:
        print(f"atom: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
