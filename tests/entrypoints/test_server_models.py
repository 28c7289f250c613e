"""Models as a vLLM user names them, through the official openai SDK against uvicorn on
127.0.0.1: a Hugging Face model id resolved offline from a local HF cache (SmolLM2 saved into a
temporary cache layout, two revisions), `--chat-template FILE`, and generation_config.json
defaults applied to omitted fields and reported on /v1/models."""

from __future__ import annotations

import json
import os

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = "acme/smol-test"
DEFAULTS = {"temperature": 0.0, "max_new_tokens": 5, "do_sample": True}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\nCUSTOM-TEMPLATE:"
)


def _snapshot(cache, commit: str, source, generation: dict | None) -> None:
    folder = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    folder.mkdir(parents=True)
    for f in source.iterdir():
        (folder / f.name).symlink_to(f)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))


@pytest.fixture(scope="module")
def hf_cache(smollm2_dir, tmp_path_factory):
    """A local HF cache holding REPO at `main` (with generation defaults) and at `v2`."""
    cache = tmp_path_factory.mktemp("hf-cache")
    main, v2 = "a" * 40, "b" * 40
    _snapshot(cache, main, smollm2_dir, DEFAULTS)
    _snapshot(cache, v2, smollm2_dir, None)
    refs = cache / f"models--{REPO.replace('/', '--')}" / "refs"
    refs.mkdir()
    (refs / "main").write_text(main)
    (refs / "v2").write_text(v2)
    saved = {k: os.environ.get(k) for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    yield cache
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def hub_model_id(hf_cache) -> str:
    return REPO


MODEL_FIXTURE = "hub_model_id"


def test_revisions_and_a_missing_id_resolve_offline(hf_cache):
    from atom.config import EngineConfig
    from atom.model_loader import ModelLoadError, resolve_model

    assert resolve_model(EngineConfig(model=REPO)).name == "a" * 40
    assert resolve_model(EngineConfig(model=REPO, revision="v2")).name == "b" * 40
    with pytest.raises(ModelLoadError, match="not in the local HF cache"):
        resolve_model(EngineConfig(model="acme/absent"))
    with pytest.raises(ModelLoadError, match="revision"):
        resolve_model(EngineConfig(model=str(hf_cache), revision="v2"))


@pytest.fixture(scope="module")
def templated(engine, start_app, tmp_path_factory):
    from atom.config import ServerConfig
    from atom.entrypoints.openai.api_server import build_app

    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return start_app(build_app(engine, ServerConfig(chat_template=str(path))))


def test_model_id_and_generation_defaults_on_models(openai_client):
    card = openai_client.models.list().data[0]
    assert card.id == REPO
    assert card.generation_defaults == {"temperature": 0.0, "max_tokens": 5}


def test_generation_defaults_fill_omitted_fields(openai_client, model_id):
    messages = [{"role": "user", "content": "Tell me a story."}]
    outs = [
        openai_client.chat.completions.create(model=model_id, messages=messages, seed=seed)
        for seed in (1, 2, 3)
    ]
    # Omitted temperature: the default 0 (greedy), whatever the seed; omitted cap: 5 tokens.
    assert len({o.choices[0].message.content for o in outs}) == 1
    assert all(
        o.usage.completion_tokens == 5 and o.choices[0].finish_reason == "length" for o in outs
    )
    explicit = openai_client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=9, temperature=0
    )
    assert explicit.usage.completion_tokens == 9  # an explicit value wins


def test_chat_template_file(templated, server, model_id):
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}]}

    def rendered(url: str) -> str:
        ids = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
        return httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]

    assert rendered(templated.url).endswith("CUSTOM-TEMPLATE:")
    assert "CUSTOM-TEMPLATE" not in rendered(server.url)


def test_unreadable_chat_template_is_refused(engine):
    from atom.config import ServerConfig
    from atom.entrypoints.openai.api_server import build_app

    with pytest.raises(ValueError, match="cannot read the chat template"):
        build_app(engine, ServerConfig(chat_template="/nonexistent/template.jinja"))
