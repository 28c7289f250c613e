"""`atom serve` start-up: a broken model is a one-line error with exit 1; a good one logs the
model, dtype, device, KV capacity and listening address, then serves. Engine flags reach
`EngineConfig`; argparse refuses values outside their choices."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from atom.cli import build_parser, engine_config_from_args, server_config_from_args
from atom.config import EngineConfig, ServerConfig
from atom.entrypoints.openai.api_server import run_server


def test_broken_model_path_is_one_line_and_exit_1(tmp_path, capsys):
    rc = run_server(EngineConfig(model=str(tmp_path / "missing")), ServerConfig(port=1))
    assert rc == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing" in err and "Traceback" not in err

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert run_server(EngineConfig(model=str(broken)), ServerConfig(port=1)) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_structured_output_whitespace_flag(command, capsys):
    prompt = ["hi"] if command == "generate" else []
    flag = "--structured-output-whitespace"
    args = build_parser().parse_args([command, *prompt, flag, "compact"])
    assert engine_config_from_args(args).structured_output_whitespace == "compact"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, *prompt, flag, "tabs"])
    assert exc.value.code == 2
    assert "invalid choice: 'tabs'" in capsys.readouterr().err


def test_structured_output_worker_flags(capsys):
    flags = ["--structured-output-processes", "3", "--structured-output-budget", "2.5"]
    config = server_config_from_args(build_parser().parse_args(["serve", *flags]))
    assert (config.structured_output_processes, config.structured_output_budget_s) == (3, 2.5)
    for bad in (["--structured-output-processes", "0"], ["--structured-output-budget", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
        assert "must be above 0" in capsys.readouterr().err


def test_tool_call_parser_flag(capsys):
    args = build_parser().parse_args(["serve", "--tool-call-parser", "dsml"])
    assert server_config_from_args(args).tool_call_parser == "dsml"
    assert server_config_from_args(build_parser().parse_args(["serve"])).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "xml"])


def test_unknown_adapter_is_one_line_and_exit_1(capsys):
    assert run_server(EngineConfig(), ServerConfig(model_adapter="nope")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "generic" in err


@pytest.mark.slow
def test_cli_serve_logs_and_serves(smollm2_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "atom.cli", "serve", "--model", str(smollm2_dir)]
    cmd += ["--port", str(port), "--max-model-len", "256", "--kv-cache-bytes", str(16 << 20)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.5)
        assert models["data"][0]["context_window"] == 256
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode in (0, 130), out  # 130: stopped by Ctrl-C (SIGINT)
    assert f"listening on http://127.0.0.1:{port}" in out
    for word in ("model ", "dtype float32", "device cpu", "KV cache ", " tokens"):
        assert word in out, (word, out)
