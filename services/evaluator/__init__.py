from services.evaluator.service import EvaluatorService

__all__ = ["EvaluatorService"]
