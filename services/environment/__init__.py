"""The environment role: multi-turn episodes' environments and their tools (see service.py and base.py)."""

from services.environment.service import EnvironmentService

__all__ = ["EnvironmentService"]
