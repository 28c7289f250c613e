"""Real servers for the endpoint tests: the embedded SmolLM2 on the real engine, served by
uvicorn on 127.0.0.1 (free port) in a background thread; one engine and one server per module.

A module may set `MODEL_FIXTURE` (the fixture giving the model folder), `ENGINE_KW` (EngineConfig overrides, e.g. a small max_model_len), `SERVER_KW` (ServerConfig overrides) and `MOUNTS`
({"/prefix": "adapter-name"}): each mount is another deployment adapter served from the same
engine under that path prefix, so one server covers several adapters.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator

import pytest

# A SmolLM2 chat template that opens `<think>` when the encoder is asked for thinking (as
# DeepSeek templates do); `thinking_model_dir` serves it.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if thinking is defined and thinking %}{{ '<think>\\n' }}"
    "{% if reasoning_effort is defined and reasoning_effort == 'low' %}{{ 'Briefly.\\n' }}"
    "{% elif reasoning_effort is defined and reasoning_effort == 'max' %}"
    "{{ 'Very very very carefully, checking every step twice.\\n' }}"
    "{% elif reasoning_effort is defined %}{{ 'Carefully, step by step.\\n' }}{% endif %}"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def thinking_model_dir(smollm2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-thinking")
    for f in smollm2_dir.iterdir():
        if f.name == "chat_template.jinja":
            continue
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
        else:
            shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


DEFAULT_ENGINE_KW = {"max_model_len": 512, "kv_cache_bytes": 64 << 20, "max_num_seqs": 8}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UvicornThread:
    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> UvicornThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def engine(request):
    from atom.config import EngineConfig
    from atom.model_engine.async_llm import AsyncLLM

    kw = {**DEFAULT_ENGINE_KW, **getattr(request.module, "ENGINE_KW", {})}
    # A module may serve another model folder: MODEL_FIXTURE names the fixture that makes it.
    model_dir = request.getfixturevalue(getattr(request.module, "MODEL_FIXTURE", "smollm2_dir"))
    eng = AsyncLLM(EngineConfig(model=str(model_dir), **kw))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(request, engine) -> Iterator[UvicornThread]:
    from atom.config import ServerConfig
    from atom.entrypoints.openai.api_server import build_app

    app = build_app(engine, ServerConfig(**getattr(request.module, "SERVER_KW", {})))
    for prefix, adapter in getattr(request.module, "MOUNTS", {}).items():
        app.mount(prefix, build_app(engine, ServerConfig(model_adapter=adapter)))
    srv = UvicornThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model_id(engine) -> str:
    return engine.model_name


@pytest.fixture
def wait_idle(engine):
    """Wait until no request is waiting or running and every KV block is free again."""

    def wait(timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while True:
            s = engine.stats()
            if (
                s.num_running == 0
                and s.num_waiting == 0
                and s.num_free_blocks == s.num_total_blocks
            ):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {s}")
            time.sleep(0.05)

    return wait


@pytest.fixture(scope="module")
def openai_client(server):
    """The official `openai` SDK on the module's server, validating every response strictly."""
    import openai

    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )


@pytest.fixture(scope="module")
def start_app():
    """``start(app)``: serve another app (e.g. other ServerConfig) with uvicorn on 127.0.0.1;
    stopped with the module."""
    started: list[UvicornThread] = []

    def start(app) -> UvicornThread:
        started.append(UvicornThread(app).start())
        return started[-1]

    yield start
    for srv in started:
        srv.stop()
