"""DeepSeek V4's prompt format, written in Python as DeepSeek ships it (its checkpoints carry an
encoding module, not a Jinja chat template)::

    <｜begin▁of▁sentence｜>{system}\\n\\n{tools section}<｜User｜>{question}<｜Assistant｜>
    <think>{reasoning}</think>{answer}\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>
    <｜end▁of▁sentence｜><｜User｜><tool_result>{result}</tool_result><｜Assistant｜><think>

(one line in the real prompt). The rules DeepSeek's encoder follows:

- a system turn has no marker; the tools section (tool_parsers/dsml.py writes it, and the
  assistant's earlier calls, so the prompt and the parser agree on the format) joins the first;
- a tool result has no role of its own: a run of tool and user messages is one user turn, the
  results as ``<tool_result>`` blocks in the order of the calls they answer;
- after ``<｜Assistant｜>``, ``<think>`` opens the reasoning (thinking on) and ``</think>``
  skips it; earlier turns' reasoning is dropped, unless the request has tools: an agent loop
  keeps every turn's reasoning, each turn reopened with ``<think>``;
- the effort level ``max`` puts a preamble before everything; DeepSeek's encoder words no other
  level, so ``low`` and ``high`` render alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from atom.entrypoints.encoders.base import ChatEncoder, ChatTemplateError
from atom.entrypoints.tool_parsers.base import ToolCall
from atom.entrypoints.tool_parsers.dsml import DsmlParser
from atom.entrypoints.tool_parsers.prompt import message_calls

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"

MAX_EFFORT = (
    "Reasoning effort: maximum, no shortcuts. Break the problem down completely to reach its "
    "root cause, and test your reasoning against every path, edge case and adversarial input. "
    "Write out each step, each alternative you weigh and each idea you reject, so that no "
    "assumption goes unchecked.\n\n"
)
THINKING_RULE = (
    f"In thinking mode (opened by {THINK}), write all of your reasoning inside "
    f"{THINK}...{END_THINK} before any tool call or answer; otherwise write the tool calls or "
    f"the answer right after {END_THINK}."
)


@dataclass
class _Turn:
    role: str  # "system", "user" or "assistant"
    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _user_text(run: list[dict[str, Any]], order: dict[str, int]) -> str:
    """One user turn from a run of user and tool messages: the text in place, the results in
    the order of the calls they answer, parts apart by a blank line."""
    results = iter(
        sorted(
            (m for m in run if m["role"] == "tool"),
            key=lambda m: order.get(m.get("tool_call_id") or "", 0),
        )
    )
    parts = [
        f"<tool_result>{next(results).get('content') or ''}</tool_result>"
        if m["role"] == "tool"
        else m.get("content") or ""
        for m in run
    ]
    return "\n\n".join(parts)


def _turns(messages: list[dict[str, Any]]) -> list[_Turn]:
    turns: list[_Turn] = []
    order: dict[str, int] = {}  # call id -> its place among the last assistant turn's calls
    for is_user, group in groupby(messages, key=lambda m: m.get("role") in ("user", "tool")):
        if is_user:
            turns.append(_Turn("user", _user_text(list(group), order)))
            continue
        for message in group:
            role = message.get("role")
            if role == "system":
                turns.append(_Turn("system", message.get("content") or ""))
                continue
            if role != "assistant":
                raise ChatTemplateError(f"DeepSeek V4 has no {role!r} role")
            calls = message_calls(message)
            reasoning = message.get("reasoning_content") or ""
            turns.append(_Turn("assistant", message.get("content") or "", reasoning, calls))
            if calls:
                ids = [tc.get("id") for tc in message.get("tool_calls") or ()]
                order = {tc_id: i for i, tc_id in enumerate(ids) if tc_id}
    return turns


class DeepseekV4Encoder(ChatEncoder):
    name = "deepseek-v4"
    renders_tools = True

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """``template_kwargs``: ``thinking`` (on/off) and ``reasoning_effort``, as the DeepSeek
        adapters pass them."""
        kwargs = template_kwargs or {}
        thinking = bool(kwargs.get("thinking"))
        parser = DsmlParser(tools)
        turns = _turns(messages)
        if not turns or turns[-1].role != "user":
            raise ChatTemplateError("a DeepSeek V4 conversation ends with a user or tool message")
        if tools:
            section = f"{parser.instructions(tools)}\n\n{THINKING_RULE}"
            if turns[0].role != "system":
                turns.insert(0, _Turn("system"))
            turns[0].text = "\n\n".join(p for p in (turns[0].text, section) if p)
        keep_reasoning = thinking and bool(tools)
        out = [BOS, MAX_EFFORT if thinking and kwargs.get("reasoning_effort") == "max" else ""]
        for i, turn in enumerate(turns):
            if turn.role == "system":
                out.append(turn.text)
            elif turn.role == "user":
                out.append(USER + turn.text)
                last = i == len(turns) - 1
                if last or turns[i + 1].role == "assistant":
                    opens = keep_reasoning or (thinking and last)
                    out.append(ASSISTANT + (THINK if opens else END_THINK))
            else:
                reasoning = turn.reasoning + END_THINK if keep_reasoning else ""
                calls = f"\n\n{parser.render_calls(turn.calls)}" if turn.calls else ""
                out.append(reasoning + turn.text + calls + EOS)
        return "".join(out)
