"""The sampling defaults a checkpoint ships in `generation_config.json`, as vLLM applies them:
each fills a request field the client omitted (an explicit value always wins), and
`max_new_tokens` caps an omitted output limit. Other keys (`do_sample`, beams...) are not
sampling defaults of this server and are not read."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field, with the type it must have.
_FIELDS = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}


def generation_defaults(model_folder: str | None) -> dict[str, float | int]:
    """The defaults in ``model_folder/generation_config.json`` by SamplingParams field (empty
    when there is no such file; a malformed one is logged and ignored as a whole)."""
    if model_folder is None:
        return {}
    path = Path(model_folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    out: dict[str, float | int] = {}
    for key, (name, kind) in _FIELDS.items():
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = kind(value)
    return out
