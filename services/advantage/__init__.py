from services.advantage.service import AdvantageService

__all__ = ["AdvantageService"]
