"""Build a native model from an HF folder and load its safetensors weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from atom.model_loader.resolve import ModelLoadError
from atom.models import MODEL_REGISTRY


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - surfaced as a one-line load error
        raise ModelLoadError(f"cannot read config.json in {folder}: {e}") from None


def build_model(hf_config, folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    archs = getattr(hf_config, "architectures", None) or []
    cls = next((MODEL_REGISTRY[a] for a in archs if a in MODEL_REGISTRY), None)
    if cls is None:
        raise ModelLoadError(
            f"unsupported architecture {archs} in {folder}; supported: {sorted(MODEL_REGISTRY)}"
        )
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(torch.float32)
    load_weights(model, folder)
    return model.eval()


def load_weights(model: nn.Module, folder: Path) -> None:
    """Copy every checkpoint tensor into its (possibly packed) parameter via its weight_loader."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"unreadable weights file {file}: {e}") from None
        with handle:
            for name in handle.keys():
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                target, shard = name, None
                for ckpt_part, (param_part, shard_id) in packed.items():
                    if f".{ckpt_part}." in name:
                        target, shard = name.replace(ckpt_part, param_part), shard_id
                        break
                param = params.get(target)
                if param is None:
                    raise ModelLoadError(f"unexpected weight {name!r} in {file}")
                loader = getattr(param, "weight_loader", None)
                tensor = handle.get_tensor(name)
                if loader is None:
                    param.data.copy_(tensor)
                elif shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
                loaded.add(target)
    missing = {n for n in params if n not in loaded}
    if tied:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(f"weights missing from {folder}: {sorted(missing)[:5]}")
