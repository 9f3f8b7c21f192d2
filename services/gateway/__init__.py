"""The gateway role: agents you already have run the episodes through an OpenAI-compatible API (service.py)."""

from services.gateway.service import GatewayService

__all__ = ["GatewayService"]
