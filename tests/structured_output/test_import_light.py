"""Importing ``atom.structured_output`` loads nothing heavy and allocates nothing."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["llguidance", "re2", "triton", "jsonschema", "transformers"]
SUBMODULES = ["manager", "backend_guidance", "utils", "schema", "spec", "answer", "admission"]


def _loaded(code: str) -> dict:
    probe = (
        "import json, sys\n"
        f"{code}\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        f"subs = [m for m in {SUBMODULES!r} if 'atom.structured_output.' + m in sys.modules]\n"
        "cuda = 'torch' in sys.modules and sys.modules['torch'].cuda.is_initialized()\n"
        "print(json.dumps({'heavy': heavy, 'subs': subs, 'cuda': cuda}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_entry_point_is_lazy() -> None:
    import atom.structured_output as so

    assert sorted(so.__all__) == sorted(so._LAZY)


def test_package_import_is_free() -> None:
    state = _loaded("import atom.structured_output as so; names = dir(so)")
    assert state == {"heavy": [], "subs": [], "cuda": False}


def test_entry_points_resolve_lazily() -> None:
    state = _loaded(
        "import atom.structured_output as so\n"
        "assert so.MaskBuffers and so.tokenizer_fingerprint\n"
        "so.MaskBuffers(129280)"
    )
    assert "llguidance" not in state["heavy"] and "triton" not in state["heavy"]
    assert set(state["subs"]) == {"utils", "backend_guidance"}
    assert state["cuda"] is False
