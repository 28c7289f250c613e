"""ATOM: a compact LLM inference engine with guaranteed structured output."""

__version__ = "0.1.0"
