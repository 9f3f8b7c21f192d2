from services.feeder.service import FeederService

__all__ = ["FeederService"]
