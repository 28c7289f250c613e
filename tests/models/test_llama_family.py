"""Config switches of the Llama family (Qwen2: q/k/v bias, untied head; Qwen3: q/k RMSNorm)
against transformers on tiny random-weight checkpoints: the engine's raw top-5 logprobs at each
generated position must match transformers' full forward over the same tokens."""

from __future__ import annotations

import pytest
import torch

from atom.llm import LLM
from atom.sampling_params import SamplingParams

COMMON = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _build(kind: str, folder, tokenizer_dir) -> None:
    import transformers as tf

    if kind == "llama":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=True)
        cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
        cls = tf.Qwen2ForCausalLM
    else:
        cfg = tf.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False)
        cls = tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # non-trivial biases and norms, so a missed switch shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_family_matches_transformers(kind, tmp_path, smollm2_dir):
    from transformers import AutoModelForCausalLM

    _build(kind, tmp_path, smollm2_dir)
    llm = LLM(str(tmp_path), tokenizer=str(smollm2_dir), device="cpu", dtype="float32")
    prompts = [[5 + 7 * i % 900 for i in range(n)] for n in (3, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        full = torch.tensor([prompt + out.output_token_ids[:-1]])
        with torch.inference_mode():
            ref = hf(full).logits[0, len(prompt) - 1 :].log_softmax(-1)
        for step, lp in enumerate(out.logprobs):
            ref_top, ref_ids = ref[step].topk(5)
            assert [i for i, _ in lp.top] == ref_ids.tolist(), (kind, step)
            assert [v for _, v in lp.top] == pytest.approx(ref_top.tolist(), abs=1e-4)
