"""The stream skeleton every endpoint formats: reasoning and answer deltas in order, logprobs on
the first delta of each engine step, tool calls streamed (start, argument fragments, done), then
exactly one outcome. Runs a real `ServingContext` on
a scripted engine (any `EngineClient` will do), with the SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from atom.config import EngineConfig, ServerConfig
from atom.entrypoints.engine_client import EngineClient
from atom.entrypoints.openai.errors import APIError
from atom.entrypoints.openai.pieces import (
    AnswerDelta,
    Failed,
    Finished,
    HeldLogprobs,
    ReasoningDelta,
    ToolArgumentsDelta,
    ToolCallDone,
    ToolCallStart,
    generate_pieces,
)
from atom.entrypoints.openai.serving_engine import RenderedPrompt, ServingContext
from atom.entrypoints.openai.tool_calls import FunctionTool, ToolRequest
from atom.entrypoints.tool_parsers import ToolCall
from atom.model_engine.output import EngineStats, RequestOutput, TokenLogprob
from atom.sampling_params import SamplingParams


class ScriptedEngine:
    """Replays outputs (an exception is raised where it stands); records aborts."""

    def __init__(self, tokenizer, hf_config, script: list[RequestOutput | Exception]):
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.config = EngineConfig(max_model_len=512)
        self.model_name = "scripted"
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.script = script
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params, prefix_source=None):
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def collective_rpc(self, method, *args, **kwargs):
        raise AssertionError("no constrained request here")

    def stats(self):
        return EngineStats(num_waiting=0, num_running=0, num_free_blocks=1, num_total_blocks=1)

    def structured_output_stats(self):
        return {}

    def check_health(self):
        return None


def outputs(*deltas: str, reason: str = "stop", stop=None, error=None) -> list[RequestOutput]:
    """One engine step per delta, one token each; the last one finishes with `reason`."""
    steps, text = [], ""
    for i, delta in enumerate(deltas):
        text += delta
        last = i == len(deltas) - 1
        steps.append(
            RequestOutput(
                request_id="r",
                prompt_token_ids=[1, 2, 3],
                output_token_ids=list(range(i + 1)),
                new_token_ids=[i],
                text=text,
                delta_text=delta,
                finished=last,
                finish_reason=reason if last else None,
                stop_reason=stop if last else None,
                logprobs=[TokenLogprob(token_id=i, logprob=-0.5, top=[(i, -0.5)])],
                error=error if last else None,
                num_cached_tokens=0,
            )
        )
    return steps


@pytest.fixture(scope="module")
def tokenizer_and_config(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir), AutoConfig.from_pretrained(smollm2_dir)


def run(
    tokenizer_and_config,
    script,
    *,
    adapter="generic",
    in_reasoning=False,
    logprobs=None,
    tools=None,
):
    engine = ScriptedEngine(*tokenizer_and_config, script)
    assert isinstance(engine, EngineClient)
    serving = ServingContext(engine, ServerConfig(model_adapter=adapter))
    rendered = RenderedPrompt("prompt", [1, 2, 3], in_reasoning, thinking=None)
    params = SamplingParams(max_tokens=8, logprobs=logprobs)

    async def collect():
        tracker = serving.metrics.tracker("chat")
        pieces = generate_pieces(serving, "r", rendered, params, tracker, tools)
        return [p async for p in pieces]

    return asyncio.run(collect()), engine


def test_answer_deltas_then_finished(tokenizer_and_config):
    pieces, _ = run(tokenizer_and_config, outputs("Hel", "lo", reason="length"))
    assert pieces[:2] == [AnswerDelta("Hel"), AnswerDelta("lo")]
    assert pieces[2] == Finished(
        finish_reason="length",
        stop_string=None,
        reasoning="",
        answer="Hello",
        prompt_tokens=3,
        output_tokens=2,
        cached_tokens=0,
        reasoning_tokens=0,
    )


def test_reasoning_split_logprobs_and_held_text(tokenizer_and_config):
    script = outputs("abc", "</th", "ink>\nxy", "z", stop=" end")
    pieces, _ = run(
        tokenizer_and_config, script, adapter="deepseek-v4.1", in_reasoning=True, logprobs=1
    )
    lps = [step.logprobs for step in script]
    assert pieces[:4] == [
        ReasoningDelta("abc", lps[0]),
        HeldLogprobs(lps[1]),  # "</th" might be the end marker: held back
        AnswerDelta("xy", lps[2]),
        AnswerDelta("z", lps[3]),
    ]
    done = pieces[4]
    assert isinstance(done, Finished) and len(pieces) == 5
    assert (done.reasoning, done.answer, done.stop_string) == ("abc", "xyz", " end")
    assert done.finish_reason == "stop" and done.reasoning_tokens > 0


@pytest.mark.parametrize("reason", ["error", "abort"])
def test_an_engine_error_or_abort_fails_without_showing_its_text(tokenizer_and_config, reason):
    error = "structured output: grammar refused" if reason == "error" else None
    pieces, _ = run(tokenizer_and_config, outputs("ok", " bad", reason=reason, error=error))
    assert pieces[0] == AnswerDelta("ok") and len(pieces) == 2
    failed = pieces[1]
    assert isinstance(failed, Failed) and failed.error.status == 500
    if reason == "error":
        assert failed.error.code == "structured_output_error" and failed.error.message == error
    else:
        assert failed.error.code == "generation_error"


def test_errors_mid_stream_end_it_with_failed_and_abort_the_request(tokenizer_and_config):
    refused = APIError("refused", status=400)
    pieces, engine = run(tokenizer_and_config, [*outputs("a", "b")[:1], refused])
    assert pieces == [AnswerDelta("a"), Failed(refused)]
    assert engine.aborted == ["r"]
    pieces, _ = run(tokenizer_and_config, [RuntimeError("boom")])
    assert len(pieces) == 1 and pieces[0].error.code == "internal_error"
    assert "boom" in pieces[0].error.message


WEATHER = FunctionTool("get_weather", None, {"type": "object"}, False, "tools[0]")
AUTO = ToolRequest("json-tags", (WEATHER,), "auto", None, True, "tool_choice")
CALL = ["Hi <tool", '_call>{"name": "get_weather", "arguments": {"city": "Pa', 'ris", "days": 3']


def test_a_call_streams_its_start_fragments_then_itself(tokenizer_and_config):
    script = outputs(*CALL, "}}</tool_call>", " ok")
    pieces, _ = run(tokenizer_and_config, script, tools=AUTO)
    arguments = '{"city": "Paris", "days": 3}'
    assert pieces[:-1] == [
        AnswerDelta("Hi "),
        ToolCallStart(0, "get_weather"),
        ToolArgumentsDelta(0, '{"city": "Pa'),
        ToolArgumentsDelta(0, 'ris"'),
        ToolArgumentsDelta(0, ', "days": 3}'),
        ToolCallDone(0, ToolCall("get_weather", arguments)),
        AnswerDelta(" ok"),
    ]
    done = pieces[-1]
    assert isinstance(done, Finished) and done.finish_reason == "tool_calls"
    assert done.tool_calls == (ToolCall("get_weather", arguments),) and done.answer == "Hi  ok"


def test_a_call_cut_off_after_its_start_ends_as_written_or_fails_the_turn(
    tokenizer_and_config,
):
    """By the output cap: a "length" answer with the call as far as it was written; by the
    model's end of output: the turn fails."""
    pieces, _ = run(tokenizer_and_config, outputs(*CALL, reason="length"), tools=AUTO)
    assert isinstance(pieces[1], ToolCallStart)
    done = pieces[-1]
    assert isinstance(done, Finished) and done.finish_reason == "length"
    (call,) = done.tool_calls
    assert call.arguments == '{"city": "Paris"' and "ended inside" in call.error
    pieces, _ = run(tokenizer_and_config, outputs(*CALL, reason="stop"), tools=AUTO)
    failed = pieces[-1]
    assert isinstance(failed, Failed) and failed.error.code == "tool_call_error"
    assert "'get_weather'" in failed.error.message and "ended inside" in failed.error.message
