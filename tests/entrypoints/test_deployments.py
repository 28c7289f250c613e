"""Deployment adapters as data: /v1/models fields, limits, effort validation, ignored tools.

Checkpoint configs are plain dicts shaped like HF `config.json` files (not engine mocks)."""

from __future__ import annotations

import pytest

from atom.entrypoints.deployments import (
    ADAPTERS,
    EffortError,
    ThinkingChoice,
    deployment_limits,
    describe_model,
    get_adapter,
)

LLAMA_CFG = {"model_type": "llama", "max_position_embeddings": 8192}
V4_CFG = {"model_type": "deepseek_v4", "max_position_embeddings": 1_048_576}
VISION_CFG = {
    "model_type": "deepseek_v4",
    "max_position_embeddings": 1_048_576,
    "vision_config": {"hidden_size": 1024},
}


def card(name, cfg, configured=None):
    return describe_model(get_adapter(name, cfg), "m", 123, configured, cfg)


def test_generic_card_keeps_openai_fields_and_bounds_context():
    c = card("generic", LLAMA_CFG, configured=2048)
    assert c["id"] == "m" and c["object"] == "model" and c["created"] == 123
    assert c["owned_by"] == "atom"
    assert c["context_window"] == 2048  # min(configured, checkpoint)
    assert c["max_output_tokens"] == 2048
    assert c["input_modalities"] == ["text"] and c["output_modalities"] == ["text"]
    assert "reasoning_effort" not in c  # unknown capability: omitted
    # configured larger than the checkpoint: the checkpoint bounds it
    assert card("generic", LLAMA_CFG, configured=100_000)["context_window"] == 8192


def test_v41_cap_and_effort_levels():
    c = card("deepseek-v4.1", V4_CFG, configured=None)
    assert c["context_window"] == 1_048_576
    assert c["max_output_tokens"] == 393_216  # bounded by the API limit
    assert c["reasoning_effort"] == {"supported": ["low", "high", "max"], "default": "high"}
    small = card("deepseek-v4.1", V4_CFG, configured=4096)
    assert small["max_output_tokens"] == 4096  # ... and by the context


def test_v41_is_derived_from_the_checkpoint_not_the_alias():
    assert get_adapter(None, V4_CFG).name == "deepseek-v4.1"
    assert get_adapter(None, LLAMA_CFG).name == "generic"
    # The served alias plays no part: no adapter name is taken from a model id.
    assert (
        describe_model(get_adapter(None, LLAMA_CFG), "deepseek-v4.1", 0, 512, LLAMA_CFG)[
            "deployment"
        ]
        == "generic"
    )


def test_dspark_advertises_text_only_even_with_vision_checkpoint():
    assert card("generic", VISION_CFG)["input_modalities"] == ["text", "image"]
    assert card("deepseek-v4-dspark", VISION_CFG)["input_modalities"] == ["text"]
    assert card("dspark", VISION_CFG)["deployment"] == "deepseek-v4-dspark"


def test_flash_ignores_hosted_web_search_only():
    flash = get_adapter("deepseek-v4-flash")
    assert flash.is_ignored_tool({"type": "web_search"})
    assert flash.is_ignored_tool({"type": "web_search_2025_08_26"})
    assert flash.is_ignored_tool({"type": "web_search_20250305"})
    assert flash.is_ignored_tool({"type": "web_search_preview_2025_03_11"})
    assert not flash.is_ignored_tool({"type": "web_search_tool"})
    assert not flash.is_ignored_tool({"type": "function", "name": "f"})
    assert not get_adapter("generic").is_ignored_tool({"type": "web_search"})


def test_unknown_adapter_name_lists_choices():
    with pytest.raises(ValueError, match="generic"):
        get_adapter("no-such-adapter")


def test_context_unknown_is_an_error():
    with pytest.raises(ValueError):
        deployment_limits(get_adapter("generic"), None, {"model_type": "x"})


@pytest.mark.parametrize("adapter", [a.name for a in ADAPTERS])
def test_none_turns_thinking_off_everywhere(adapter):
    a = get_adapter(adapter)
    assert a.resolve_thinking("none", None, "reasoning_effort") == ThinkingChoice(False, None)


def test_effort_validation_per_adapter():
    v41 = get_adapter("deepseek-v4.1")
    assert v41.resolve_thinking("max", None, "p") == ThinkingChoice(True, "max")
    assert v41.resolve_thinking(None, None, "p") == ThinkingChoice(True, "high")  # default
    assert v41.resolve_thinking(None, False, "p") == ThinkingChoice(False, None)
    with pytest.raises(EffortError) as e:
        v41.resolve_thinking("medium", None, "reasoning.effort")
    assert e.value.param == "reasoning.effort"
    assert "'low', 'high', 'max'" in str(e.value)
    generic = get_adapter("generic")
    with pytest.raises(EffortError, match="no effort levels"):
        generic.resolve_thinking("high", None, "reasoning_effort")
    assert generic.resolve_thinking(None, None, "p") == ThinkingChoice(None, None)


def test_template_kwargs_carry_the_choice():
    v41 = get_adapter("deepseek-v4.1")
    kw = v41.template_kwargs(ThinkingChoice(True, "max"))
    assert kw["thinking"] is True and kw["reasoning_effort"] == "max"
    assert get_adapter("generic").template_kwargs(ThinkingChoice(None, None)) == {}
    assert get_adapter("generic").template_kwargs(ThinkingChoice(False, None)) == {
        "enable_thinking": False
    }
