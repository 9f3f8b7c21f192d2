from services.learner.service import LearnerService

__all__ = ["LearnerService"]
