"""A first-start model conversion killed with `kill -9` leaves its temp folder behind; the next
start removes it, and keeps the folder of a conversion that is still running elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from atom.config import EngineConfig
from atom.model_loader import resolve_model
from atom.model_loader.resolve import embedded_gguf

pytestmark = pytest.mark.slow


def test_kill_9_during_conversion_is_cleaned_up_at_the_next_start(
    tmp_path, monkeypatch, smollm2_dir
):
    cache = tmp_path / "cache"
    env = {**os.environ, "ATOM_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    code = "from atom.model_loader import resolve_model; from atom.config import EngineConfig; "
    code += "resolve_model(EngineConfig())"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob(".convert-*")):
            assert proc.poll() is None, "the conversion ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    (left,) = cache.glob(".convert-*")
    assert str(proc.pid) in left.name
    # Another conversion still running (this process), and a folder naming no process that is
    # recent: both kept.
    live = cache / f".convert-{os.getpid()}-abc"
    live.mkdir()
    unowned = cache / ".convert-xyz"
    unowned.mkdir()
    # The next start: the converted folder is already there (linked), so nothing converts again.
    gguf = embedded_gguf()
    (cache / f"{gguf.stem}-{gguf.stat().st_size}").symlink_to(smollm2_dir)
    monkeypatch.setenv("ATOM_CACHE_DIR", str(cache))
    resolve_model(EngineConfig())
    assert not left.exists()
    assert live.is_dir() and unowned.is_dir()
