from dspark.engine.engine import Engine, EngineConfig, EngineFull, StepEvent

__all__ = ["Engine", "EngineConfig", "EngineFull", "StepEvent"]
