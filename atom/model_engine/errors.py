"""Engine failures the serving layer maps to HTTP statuses (imported without torch)."""

from __future__ import annotations

# How the message of an `EngineDeadError` starts, and so the error of every request it ended.
ENGINE_DEAD = "engine is dead"


class EngineDeadError(RuntimeError):
    """A rank died, hung past its timeout or lost its transport: the engine cannot serve any
    more requests (the server answers 503 and reports unhealthy)."""
