"""A Hugging Face model id (`org/name`) as a local folder: the snapshot in the local HF cache
at the requested revision, or, when the hub is reachable (HF_HUB_OFFLINE unset), downloaded
into it. Only the files the engine loads are fetched."""

from __future__ import annotations

import re
from pathlib import Path

from atom import envs

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def is_hub_id(model: str) -> bool:
    """`org/name` that is not a local path."""
    return _REPO_ID.fullmatch(model) is not None and not Path(model).expanduser().exists()


def hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """The local folder of ``repo_id`` at ``revision``; raises ``FileNotFoundError`` (or
    huggingface_hub's error) with the reason when it is neither cached nor downloadable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    kwargs = {"revision": revision, "cache_dir": envs.hf_cache_dir(), "allow_patterns": _PATTERNS}
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
    except LocalEntryNotFoundError:
        if envs.hf_hub_offline():
            raise FileNotFoundError(
                f"{repo_id} (revision {revision or 'main'}) is not in the local HF cache and "
                "HF_HUB_OFFLINE is set"
            ) from None
    return Path(snapshot_download(repo_id, **kwargs))
