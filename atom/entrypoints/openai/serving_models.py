"""GET /v1/models: deployment limits and capabilities (see entrypoints/deployments.py)."""

from __future__ import annotations

from typing import Any

from atom.entrypoints.openai.errors import model_not_found
from atom.entrypoints.openai.serving_engine import ServingContext


class ServingModels:
    def __init__(self, serving: ServingContext):
        self.s = serving

    def list(self) -> dict[str, Any]:
        return {"object": "list", "data": self.s.model_cards()}

    def get(self, model_id: str) -> dict[str, Any]:
        for card in self.s.model_cards():
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id, self.s.served_names)
