"""The structured-output promise, end to end (embedded SmolLM2, uvicorn on 127.0.0.1, the
official openai SDK): a constrained answer is schema-valid or an error, a correct answer is never
a 500, and no request stalls another (``/health`` answers while hostile schemas are prepared)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from atom.structured_output.schema import DIALECT

pytestmark = pytest.mark.slow

ENGINE_KW = {"max_num_seqs": 8}
PROMPT = [{"role": "user", "content": "Reply in JSON."}]


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def hostile_schema(n: int) -> dict:
    """Seconds of preparation (every enum value checked against ``n`` patterns); accepted."""
    patterns = [{"pattern": f"^value[0-9]{{4}}$|z{i}"} for i in range(n)]
    values = [f"value{i:04d}" for i in range(n)]
    return {"type": "object", "properties": {"v": {"enum": values, "not": {"allOf": patterns}}}}


# The answer is forced to 30 "a" then "!": Python's backtracking ``re`` would take minutes on
# the first pattern, which a nested dialect declaration used to send it to.
NESTED_DIALECT = {
    "type": "object",
    "properties": {
        "s": {
            "$schema": DIALECT,
            "type": "string",
            "pattern": "^(a+)+$|!$",
            "allOf": [{"pattern": "^a{30}!$"}],
        }
    },
    "required": ["s"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="x",
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )


def test_health_answers_while_hostile_schemas_are_prepared(server, model_id):
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key="x",
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )

    async def ask(schema: dict) -> tuple[str, float]:
        start = time.monotonic()
        try:
            await client.chat.completions.create(
                model=model_id,
                messages=PROMPT,
                response_format=json_schema(schema),
                max_tokens=48,
                temperature=0,
            )
            outcome = "ok"
        except openai.BadRequestError as exc:
            outcome = f"400 {exc.body}"
        return outcome, time.monotonic() - start

    async def health_latencies(until: asyncio.Future) -> list[float]:
        latencies = []
        async with httpx.AsyncClient(base_url=server.url) as http:
            while not until.done():
                start = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.02)
        return latencies

    async def run():
        hostile = [hostile_schema(150), hostile_schema(149), NESTED_DIALECT]
        requests = asyncio.gather(*(ask(s) for s in hostile))
        latencies = await health_latencies(requests)
        first = await requests
        preparations = schema_preparations(server.url)
        again = await ask(hostile[0])
        return latencies, first, again, schema_preparations(server.url) - preparations

    latencies, first, again, new_preparations = asyncio.run(run())
    assert [outcome for outcome, _ in first] == ["ok"] * 3, first
    assert len(latencies) > 10
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    assert again[0] == "ok"
    assert new_preparations == 0  # the prepared schema came from the cache


def schema_preparations(url: str) -> float:
    """The server's count of schema preparations run in a worker (its cache misses)."""
    text = httpx.get(f"{url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("atom_structured_output_schema_prep"))
    return float(line.split()[-1])


def test_exact_multiple_of_is_a_success(server, client, model_id):
    """Every answer here (0.28, 0.29, 0.3) fails float division by 0.01."""
    price = {"type": "number", "multipleOf": 0.01, "minimum": 0.28, "maximum": 0.3}
    schema = {
        "type": "object",
        "properties": {"price": price},
        "required": ["price"],
        "additionalProperties": False,
    }

    chat = client.chat.completions.create(
        model=model_id, messages=PROMPT, response_format=json_schema(schema), temperature=0
    )
    responses = client.responses.create(
        model=model_id,
        input="Reply in JSON.",
        text={"format": {"type": "json_schema", "name": "t", "schema": schema}},
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "stop"
    assert json.loads(chat.choices[0].message.content)["price"] in (0.28, 0.29, 0.3)
    assert responses.status == "completed"
    assert json.loads(responses.output_text)["price"] in (0.28, 0.29, 0.3)


def test_big_integer_const_is_refused_with_a_pointer(server, client, model_id):
    schema = {"type": "object", "properties": {"id": {"const": 9007199254740993}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id, messages=PROMPT, response_format=json_schema(schema)
        )
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert "/properties/id/const" in error["message"] and "2**53" in error["message"]


def test_an_invalid_date_is_an_error_not_a_success(server, client, model_id):
    """The grammar's date-time regex admits February 29th of 2021; the final check does not."""
    forced = {"type": "string", "format": "date-time", "pattern": "^2021-02-29T00:00:00Z$"}
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model=model_id, messages=PROMPT, response_format=json_schema(forced)
        )
    assert info.value.body["code"] == "structured_output_error"
    assert "date-time" in info.value.body["message"]
