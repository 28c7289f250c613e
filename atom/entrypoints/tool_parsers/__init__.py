"""Tool-call formats: the generated text of a call, parsed into API tool calls, and the prompt
text that teaches the format to a model whose chat template has no tool section.

- ``json-tags``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (SmolLM2, Qwen);
- ``dsml``: DeepSeek V4's ``<｜DSML｜tool_calls>`` envelopes.

A deployment adapter names its format; ``--tool-call-parser`` overrides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from atom.entrypoints.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    Item,
    ToolCall,
    ToolParseError,
    ToolParser,
)
from atom.entrypoints.tool_parsers.dsml import DsmlParser
from atom.entrypoints.tool_parsers.json_tags import JsonTagsParser

__all__ = [
    "PARSERS",
    "ArgumentsDelta",
    "CallStart",
    "DsmlParser",
    "Item",
    "JsonTagsParser",
    "ToolCall",
    "ToolParseError",
    "ToolParser",
    "get_parser",
]

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (JsonTagsParser, DsmlParser)}


def get_parser(
    name: str, tools: Sequence[dict[str, Any]] | None, max_calls: int | None = None
) -> ToolParser:
    """A fresh parser of the format ``name`` for one response."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name](tools, max_calls)
