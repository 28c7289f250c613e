"""Every ATOM_* environment variable, read in one place (at call time, so tests can set them)."""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """Where converted models live (the embedded GGUF is dequantized here once)."""
    return Path(os.environ.get("ATOM_CACHE_DIR", Path.home() / ".cache" / "atom"))


def enable_relaxed_mtp() -> bool:
    """Relaxed speculative acceptance; structured requests are refused while it is on."""
    return _flag("ATOM_ENABLE_RELAXED_MTP")


def relaxed_mtp_top_n() -> int:
    """Relaxed acceptance: a draft among its row's this many most likely tokens..."""
    return int(os.environ.get("ATOM_RELAXED_MTP_TOP_N", "3"))


def relaxed_mtp_delta() -> float:
    """...whose probability is within this of the row's largest is accepted."""
    return float(os.environ.get("ATOM_RELAXED_MTP_DELTA", "0.1"))


def log_level() -> str:
    return os.environ.get("ATOM_LOG_LEVEL", "INFO").upper()


def hf_hub_offline() -> bool:
    """Hugging Face's own switch: resolve model ids from the local HF cache only."""
    return _flag("HF_HUB_OFFLINE")


def hf_cache_dir() -> str | None:
    """The HF hub cache (HF_HUB_CACHE, else HF_HOME/hub; None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


DEFAULT_NODE_KEY = "atom-nodes"


def node_key() -> bytes:
    """The shared secret with which the ranks of several nodes and node 0's engine
    authenticate each other's step connections (HMAC both ways); the same on every node."""
    return os.environ.get("ATOM_NODE_KEY", DEFAULT_NODE_KEY).encode()


def node_key_is_set() -> bool:
    """Whether ATOM_NODE_KEY is set to a key of the operator's own (not the public default)."""
    return os.environ.get("ATOM_NODE_KEY", DEFAULT_NODE_KEY) != DEFAULT_NODE_KEY
