"""--gpu-memory-utilization as vLLM means it: a share of the GPU's total memory, of which the
KV cache gets what is not in use yet (CPU-testable arithmetic; the runner calls it on CUDA)."""

from __future__ import annotations

import pytest

from atom.config import EngineConfig
from atom.model_engine.model_runner import kv_budget_of_total

GIB = 1 << 30


def test_share_of_total_minus_what_is_in_use():
    # 80 GiB GPU, 10 GiB in use (weights, other processes): 0.9 * 80 - 10 = 62 GiB.
    assert kv_budget_of_total(free=70 * GIB, total=80 * GIB, utilization=0.9) == 62 * GIB
    # Another process holds half the GPU: the share of total counts it, a share of free would not.
    assert kv_budget_of_total(free=40 * GIB, total=80 * GIB, utilization=0.9) == 32 * GIB


def test_nothing_left_is_an_error():
    with pytest.raises(ValueError, match="nothing is left"):
        kv_budget_of_total(free=10 * GIB, total=80 * GIB, utilization=0.5)


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)
