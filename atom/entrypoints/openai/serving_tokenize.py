"""vLLM's POST /tokenize and /detokenize: a prompt (as /v1/completions tokenizes it) or chat
messages (as Chat renders them, template included) to token ids, and ids back to text. Both run
the tokenizer in a worker thread."""

from __future__ import annotations

from typing import Any

import anyio.to_thread

from atom.entrypoints.deployments import ThinkingChoice
from atom.entrypoints.openai.errors import bad_request
from atom.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from atom.entrypoints.openai.serving_chat import chat_messages_to_dicts
from atom.entrypoints.openai.serving_completions import prompt_token_ids
from atom.entrypoints.openai.serving_engine import ServingContext


class ServingTokenize:
    def __init__(self, serving: ServingContext):
        self.s = serving

    def _check_model(self, model: str | None) -> None:
        if model is not None:
            self.s.check_model(model)

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send either prompt or messages", param="prompt")
        if req.messages is not None:
            messages = chat_messages_to_dicts(req.messages)
            rendered = await self.s.render_async(messages, ThinkingChoice(), None, "messages")
            ids = rendered.token_ids
        else:
            ids = await anyio.to_thread.run_sync(self._encode, req.prompt, req.add_special_tokens)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.s.limits.context_window,
            "tokens": ids,
        }
        if req.return_token_strs:
            out["token_strs"] = self.s.tokenizer.convert_ids_to_tokens(ids)
        return out

    def _encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            return prompt_token_ids(self.s, prompt)
        return self.s.tokenizer.encode(prompt, add_special_tokens=False)

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        vocab = len(self.s.tokenizer)
        for i, token in enumerate(req.tokens):
            if not 0 <= token < vocab:
                raise bad_request(f"token id {token} is not below {vocab}", param=f"tokens[{i}]")
        text = await anyio.to_thread.run_sync(self.s.tokenizer.decode, req.tokens)
        return {"prompt": text}
