"""The grammar of a constrained tool-call turn, as a Lark grammar for llguidance.

A turn is one or more calls of the declared tools, in the tool parser's canonical envelope,
each call's arguments constrained by that tool's lowered parameter schema (``%json``, compiled
with the same strict options as an answer). Beside the calls the grammar may admit free text
(``tool_choice="auto"``) or an answer conforming to the answer schema (a DSML deployment with a
``response_format``). After the last call only EOS is allowed.

The formats are written here as the tool parsers read them
(``atom/entrypoints/tool_parsers``): a change of one is a change of the other.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

DSML = "｜DSML｜"
JSON_TAGS = "json-tags"
Embed = Callable[[dict], str]  # lowered schema -> the JSON text of a ``%json`` directive


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def canonical(lowered: dict) -> str:
    return json.dumps(lowered, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ToolGrammar:
    """What a worker compiles for a constrained tool turn. ``tools`` holds (name, canonical
    JSON of its lowered parameter schema); ``besides`` what the turn may be instead of calls:
    nothing, free text, or an answer of ``answer`` (canonical lowered JSON)."""

    format: Literal["json-tags", "dsml"]
    tools: tuple[tuple[str, str], ...]
    parallel: bool
    besides: Literal["nothing", "text", "answer"] = "nothing"
    answer: str | None = None

    @property
    def key(self) -> str:
        """The compile-cache key (never equal to a schema's: those hash a JSON text)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()

    def lark(self, embed: Embed) -> str:
        calls = self._json_tags(embed) if self.format == JSON_TAGS else self._dsml(embed)
        start = ["calls"]
        if self.besides == "text":
            start.append("TEXT")
            calls.append(r"TEXT: /(?s:.+)/")
        elif self.besides == "answer" and self.answer is not None:
            start.append("answer")
            calls.append(f"answer: %json {embed(json.loads(self.answer))}")
        return "\n".join([f"start: {' | '.join(start)}", *calls])

    def _json_tags(self, embed: Embed) -> list[str]:
        rules = ['calls: call ("\\n" call)*' if self.parallel else "calls: call"]
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(self.tools))))
        for i, (name, params) in enumerate(self.tools):
            head = _lit(f'<tool_call>{{"name": {json.dumps(name)}, "arguments": ')
            rules.append(f'call_{i}: {head} args_{i} "}}</tool_call>"')
            rules.append(f"args_{i}: %json {embed(json.loads(params))}")
        return rules

    def _dsml(self, embed: Embed) -> list[str]:
        calls = "invoke+" if self.parallel else "invoke"
        rules = [
            f'calls: {_lit(f"<{DSML}tool_calls>")} "\\n" {calls} {_lit(f"</{DSML}tool_calls>")}'
        ]
        rules.append("invoke: " + " | ".join(f"invoke_{i}" for i in range(len(self.tools))))
        rules.append("RAW: /(?s:[^<]*)/")
        for i, (name, params) in enumerate(self.tools):
            schema = json.loads(params)
            parts = [_lit(f'<{DSML}invoke name="{name}">\n')]
            for j, (key, sub) in enumerate(_properties(schema)):
                rule = f"p_{i}_{j}"
                parts.append(rule if key in schema.get("required", ()) else f"{rule}?")
                rules.append(f"{rule}: {_parameter(key, sub, schema, embed)}")
            parts.append(_lit(f"</{DSML}invoke>\n"))
            rules.append(f"invoke_{i}: {' '.join(parts)}")
        return rules


def _properties(schema: dict) -> list[tuple[str, dict]]:
    props = schema.get("properties")
    return list(props.items()) if isinstance(props, dict) else []


def is_plain_string(sub: object) -> bool:
    """A DSML string parameter without constraints, written raw (``string="true"``); any other
    value is JSON (``string="false"``), which the grammar can constrain."""
    return (
        isinstance(sub, dict)
        and sub.get("type") == "string"
        and set(sub)
        <= {
            "type",
            "description",
            "title",
        }
    )


def _parameter(key: str, sub: dict, root: dict, embed: Embed) -> str:
    """One parameter: raw text for a plain string, else JSON under the parameter's schema (with
    the root's ``$defs``, so its references resolve)."""
    raw = is_plain_string(sub)
    flag = "true" if raw else "false"
    opening = _lit(f"<{DSML}parameter name={json.dumps(key)} string={json.dumps(flag)}>")
    close = _lit(f"</{DSML}parameter>\n")
    if raw:
        return f"{opening} RAW {close}"
    scoped = {**sub, "$defs": root["$defs"]} if isinstance(root.get("$defs"), dict) else sub
    return f"{opening} %json {embed(scoped)} {close}"
