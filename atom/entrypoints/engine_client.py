"""The seam between the HTTP serving layer and the engine: everything the entrypoints use of an
engine, and nothing else. `atom.model_engine.async_llm.AsyncLLM` implements it structurally (no
inheritance), so the serving code is typed against this protocol instead of probing the engine
for what it happens to have."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from atom.config import EngineConfig
    from atom.model_engine.output import EngineStats, RequestOutput
    from atom.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """A running engine as the serving layer sees it."""

    tokenizer: PreTrainedTokenizerBase
    config: EngineConfig
    hf_config: PretrainedConfig
    model_name: str
    eos_token_ids: list[int]

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefix_source: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; leaving early aborts it. `prefix_source`:
        another running sample of the same prompt whose KV blocks this one reuses."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a request and free its KV blocks (a no-op for an unknown or finished one)."""
        ...

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run a worker method on every rank; one result per rank (structured-output admission)."""
        ...

    def stats(self) -> EngineStats:
        """Queue and KV-cache gauges, read at /metrics scrape time."""
        ...

    def structured_output_stats(self) -> dict[str, int]:
        """Live grammar states and cached grammars over every rank, read at scrape time."""
        ...

    def check_health(self) -> None:
        """Raise `EngineDeadError` once the engine loop has stopped or a rank has died (/health
        answers 503)."""
        ...
