"""Greedy parity of the native Llama (paged KV, chunked prefill, prefix caching) with
transformers on the embedded SmolLM2, fp32 CPU."""

from __future__ import annotations

import pytest
import torch

from atom.llm import LLM
from atom.sampling_params import SamplingParams

NUM_TOKENS = 32
LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from "
    "wine making. Within decades printing spread across Europe, books became cheaper, "
    "literacy rose and ideas travelled faster than ever before."
)
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    LONG + " Summarize this in one sentence:",
    LONG + " What was the press adapted from?",  # shares a multi-block prefix with the previous
]


@pytest.mark.slow
def test_greedy_parity_with_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    # A small token budget forces chunked prefill and mixed prefill/decode steps.
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", max_num_batched_tokens=64)
    tok = llm.tokenizer
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompt_ids) > 2 * llm.engine.config.block_size
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert outputs[3].num_cached_tokens > 0  # the shared prefix came from the prefix cache

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for ids, out in zip(prompt_ids, outputs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert out.output_token_ids == ref, tok.decode(ids)
