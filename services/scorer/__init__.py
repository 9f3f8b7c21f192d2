from services.scorer.service import ScorerService

__all__ = ["ScorerService"]
