from services.generator.service import GeneratorService

__all__ = ["GeneratorService"]
