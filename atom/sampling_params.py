"""Per-request generation settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20
# The range a torch.Generator seed accepts (int64 and uint64 values).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class StructuredOutputParams:
    """An output constraint for the offline API (``LLM.generate``/``LLM.chat``), as vLLM spells
    it: exactly one of a JSON Schema (or its JSON text), any JSON object, a regex the whole
    answer matches, a choice among strings, or a Lark grammar as llguidance reads it."""

    json: dict | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; 0: the sampled token's logprob only; k: also the top-k candidates.
    logprobs: int | None = None
    # vLLM's meanings: presence/frequency penalties subtract from the logits of tokens already
    # in the output (once / per occurrence); repetition_penalty divides positive (multiplies
    # negative) logits of tokens in the prompt or output; logit_bias adds to given token ids;
    # min_p drops tokens below min_p times the top probability; min_tokens forbids the stop
    # tokens until that many tokens are out. Applied before any grammar mask.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    # The tokens min_tokens forbids (EOS and stop_token_ids), set by the engine on admission.
    min_tokens_stop_ids: tuple[int, ...] = ()
    # A bound `atom.structured_output` request spec; None for ordinary requests. Offline,
    # `StructuredOutputParams` too: `LLM.generate` admits it and binds its spec.
    structured_output: Any = None
    # Only the final output is made (vLLM's FINAL_ONLY output kind; offline `LLM.generate`,
    # which keeps nothing else): its new tokens and logprobs are all of the request's.
    final_only: bool = False
    # Does this request change its logits before sampling (``model_ops.penalties``)?
    penalized: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be between {MIN_SEED} and {MAX_SEED}")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        # Read per row and step by the model runner, so computed once.
        self.penalized = bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
