"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools

from tqdm import tqdm

from atom.config import EngineConfig
from atom.model_engine.llm_engine import ExecutorFactory, LLMEngine
from atom.model_engine.output import RequestOutput
from atom.sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        executor_factory: ExecutorFactory | None = None,
        **config_overrides,
    ):
        """``executor_factory``: how the ranks are built (default: in this process for one
        rank, else worker processes); benchmarks pass ``MultiprocExecutor`` to measure the
        transport of a single rank."""
        config = config or EngineConfig()
        if model is not None:
            config_overrides["model"] = model
        self.engine = LLMEngine(dataclasses.replace(config, **config_overrides), executor_factory)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run all prompts to completion (continuous batching); outputs in prompt order, each
        carrying the logprobs of all its tokens (when asked). The engine makes each request's
        final output only (`SamplingParams.final_only`): nothing reads the others."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        per_prompt = self._bind(per_prompt)
        final_only = {id(p): dataclasses.replace(p, final_only=True) for p in per_prompt}
        order: dict[str, int] = {}
        for prompt, p in zip(prompts, per_prompt, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"llm-{next(self._ids)}"
            order[rid] = len(order)
            self.engine.add_request(rid, ids, final_only[id(p)])
        results: list[RequestOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    i = order.get(out.request_id)
                    if i is not None:
                        results[i] = self._checked(per_prompt[i], out)
                        bar.update()
        return results  # type: ignore[return-value]

    def _bind(self, per_prompt: list[SamplingParams]) -> list[SamplingParams]:
        """Admit every offline output constraint (``StructuredOutputParams``) before anything
        is queued: a refused one raises ``FormatError`` naming its field (and the JSON pointer
        of a schema keyword) or ``AdmissionError``. Each distinct params object once."""
        if not any(p.structured_output is not None for p in per_prompt):
            return per_prompt
        from atom.structured_output.offline import bind

        bound = {id(p): bind(self.engine, p) for p in per_prompt}
        return [bound[id(p)] for p in per_prompt]

    @staticmethod
    def _checked(params: SamplingParams, out: RequestOutput) -> RequestOutput:
        if params.structured_output is None:
            return out
        from atom.structured_output.offline import checked

        return checked(params, out)

    def chat(
        self,
        conversations: list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the generation prompt) and generate."""
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for conv in conversations
        ]
        return self.generate(prompts, params, use_tqdm=use_tqdm)
