"""CUDA graphs of decode steps: step inputs, the capture sizes, the `--enforce-eager` switch, no
graphs on CPU, and (on a GPU) the same greedy tokens with graphs as without, for batches that
need padding rows and for a batch with a structured-output request."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch

from atom.cli import build_parser, engine_config_from_args
from atom.llm import LLM
from atom.model_engine.cuda_graph import DecodeGraphs, graph_batch_sizes
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import Sequence
from atom.model_engine.step_inputs import block_slots, build_step_inputs
from atom.sampling_params import SamplingParams


def test_capture_sizes_cover_every_batch():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(13) == [1, 2, 4, 8, 13]
    assert graph_batch_sizes(1) == [1]
    graphs = DecodeGraphs(torch.nn.Identity(), 13, 4, torch.device("cpu"))
    assert [graphs.padded_size(n) for n in (1, 3, 5, 13, 14)] == [1, 4, 8, 13, None]


def test_block_slots_match_per_token_formula():
    table, bs = [7, 2, 9], 4
    for start, end in [(0, 12), (3, 4), (5, 11), (8, 9)]:
        expected = [table[p // bs] * bs + p % bs for p in range(start, end)]
        assert block_slots(table, start, end, bs) == expected


def _seq(prompt_len: int, computed: int, table: list[int]) -> Sequence:
    seq = Sequence("r", list(range(100, 100 + prompt_len)), SamplingParams())
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq


def test_step_inputs_pad_decode_rows():
    """A chunk that spans blocks, a decode row, then two padding rows for a size-4 graph."""
    chunk, decode = _seq(10, 2, [5, 3, 8]), _seq(6, 5, [4, 6])
    batch = ScheduledBatch(
        seqs=[chunk, decode],
        num_new_tokens=[7, 1],
        num_computed_before=[2, 5],
        sampling=[False, True],
    )
    step = build_step_inputs(batch, block_size=4, num_rows=4, pin=False)
    assert step.input_ids.tolist() == list(range(102, 109)) + [105, 0, 0]
    assert step.positions.tolist() == list(range(2, 9)) + [5, 0, 0]
    assert step.slot_mapping.tolist() == [22, 23, 12, 13, 14, 15, 32, 25, -1, -1]
    assert step.block_tables.tolist() == [[5, 3, 8], [4, 6, 0], [0, 0, 0], [0, 0, 0]]
    assert step.block_tables.dtype == step.context_lens.dtype == torch.int32
    assert step.context_lens.tolist() == [9, 6, 0, 0]
    assert step.query_lens == [7, 1]
    assert step.sample_rows.tolist() == [7]  # the chunk does not reach its end


def test_enforce_eager_flag():
    for command in (["serve"], ["generate", "hi"]):
        args = build_parser().parse_args([*command, "--enforce-eager"])
        assert engine_config_from_args(args).enforce_eager is True
        assert engine_config_from_args(build_parser().parse_args(command)).enforce_eager is False


def test_no_graphs_on_cpu(tiny_llama_dir, monkeypatch):
    def refuse(self):
        raise AssertionError("CUDA graphs captured on CPU")

    monkeypatch.setattr(DecodeGraphs, "capture", refuse)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_bytes=8 << 20)
    assert llm.engine.executor.workers[0].graphs is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out.output_token_ids) == 4


# ---- GPU: graphs against eager --------------------------------------------------------------

SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


def _cuda_llm(model_dir, enforce_eager: bool) -> LLM:
    """fp32 so that graphs and eager kernels, which may differ in reduction order, still agree
    on every greedy token; a small cache so that two engines fit side by side."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        max_num_seqs=16,
        max_model_len=256,
        kv_cache_bytes=64 << 20,
        enforce_eager=enforce_eager,
    )


@pytest.fixture(scope="module")
def cuda_engines(tiny_llama_dir):
    engines = {eager: _cuda_llm(tiny_llama_dir, eager) for eager in (False, True)}
    yield engines
    engines.clear()
    gc.collect()
    torch.cuda.empty_cache()


def _replayed_sizes(llm: LLM, monkeypatch) -> list[int]:
    """Record the padded size of every graph replay of `llm`'s runner."""
    graphs = llm.engine.executor.workers[0].graphs
    sizes: list[int] = []
    launch = graphs.launch  # every replay ends here, staged or not

    def spy(input_ids, size):
        sizes.append(size)
        return launch(input_ids, size)

    monkeypatch.setattr(graphs, "launch", spy)
    return sizes


def _greedy(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [3, 13])
def test_graphs_decode_the_same_tokens_as_eager(cuda_engines, monkeypatch, batch):
    graphed, eager = cuda_engines[False], cuda_engines[True]
    assert eager.engine.executor.workers[0].graphs is None
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(3, 60, (batch,), generator=g).tolist()
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in lens]
    max_tokens = [8 + 3 * i for i in range(batch)]  # the batch shrinks through many sizes
    sizes = _replayed_sizes(graphed, monkeypatch)
    assert _greedy(graphed, prompts, max_tokens) == _greedy(eager, prompts, max_tokens)
    padded = 4 if batch == 3 else 16
    assert padded in sizes and set(sizes) <= set(graph_batch_sizes(16))


@pytest.fixture(scope="module")
def varied_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama's shape with untied, larger random weights (fixed seed): its greedy
    tokens vary from step to step and depend on attention (the tied tiny model mostly repeats
    one token), so that a wrong key, position or block shows in them."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("varied-llama")
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.tie_word_embeddings, config.initializer_range = False, 0.2
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(folder)
    return folder


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_parity_with_transformers_on_cuda(varied_llama_dir, enforce_eager):
    """Every request of a continuous batch (prompts of one to six KV blocks), decoded with
    CUDA graphs and asynchronous scheduling or eagerly, through the paged Triton attention,
    gets the greedy tokens transformers generates for it alone on the same GPU (fp32)."""
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (5, 17, 40, 90)]
    max_tokens = [24, 12, 20, 16]
    hf = AutoModelForCausalLM.from_pretrained(varied_llama_dir, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    hf.generation_config.eos_token_id = None  # the engine ignores EOS too
    expected = []
    for ids, n in zip(prompts, max_tokens, strict=True):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        expected.append(out[0, len(ids) :].tolist())
    del hf
    assert all(len(set(tokens)) > len(tokens) // 2 for tokens in expected)  # not one repeated
    llm = _cuda_llm(varied_llama_dir, enforce_eager)
    assert _greedy(llm, prompts, max_tokens) == expected
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _admit(llm: LLM, spec) -> None:
    """Admit `spec` on every rank before the request is queued, so that both engines schedule
    the same steps (the grammar is bound at once)."""
    engine = llm.engine
    from atom.structured_output.admission import api_fingerprint

    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    deadline = time.monotonic() + 120
    while True:
        (answer,) = engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        if answer["status"] == "ready":
            return
        assert answer["status"] == "pending" and time.monotonic() < deadline, answer
        time.sleep(0.02)


@pytest.mark.gpu
def test_graphs_with_a_structured_output_request(cuda_engines, monkeypatch):
    pytest.importorskip("llguidance")
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.spec import StructuredOutputSpec

    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SMALL}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (20,), generator=g).tolist() for _ in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 5
    params[2] = SamplingParams(temperature=0.0, max_tokens=24, structured_output=spec)
    outputs = {}
    for eager, llm in cuda_engines.items():
        _admit(llm, spec)
        sizes = [] if eager else _replayed_sizes(llm, monkeypatch)
        outputs[eager] = llm.generate(prompts, params, use_tqdm=False)
        assert eager or 8 in sizes  # five sequences decode in the size-8 graph
    tokens = {eager: [o.output_token_ids for o in outs] for eager, outs in outputs.items()}
    assert tokens[False] == tokens[True]
    answer = outputs[False][2]
    assert answer.error is None and json.loads(answer.text)["a"] in range(10)


@pytest.mark.gpu
def test_text_is_the_decoded_tokens_streamed_or_final_only(cuda_engines):
    """Lazy text on CUDA (decoded ahead while the engine waits for the device, and at the end):
    each request's streamed deltas join to its final text, which is its tokens decoded, and a
    final-only request (`LLM.generate`) gets the same text."""
    llm = cuda_engines[False]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 40000, (12,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine, deltas, finals = llm.engine, {}, {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id] = deltas.get(out.request_id, "") + out.delta_text
            if out.finished:
                finals[out.request_id] = out
    generated = llm.generate(prompts, params, use_tqdm=False)
    for i, final_only in enumerate(generated):
        out = finals[f"t{i}"]
        decoded = llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
        assert deltas[f"t{i}"] == out.text == decoded
        assert final_only.output_token_ids == out.output_token_ids
        assert final_only.text == final_only.delta_text == out.text
