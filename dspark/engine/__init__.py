from dspark.engine.engine import Engine, EngineConfig, EngineFull, StepEvent
from dspark.engine.footprint import StateFootprint, StateKind, request_footprint
from dspark.engine.pages import PagePool, StateAllocator
from dspark.engine.scheduler import Scheduler

__all__ = ["Engine", "EngineConfig", "EngineFull", "PagePool", "Scheduler", "StateAllocator", "StateFootprint",
           "StateKind", "StepEvent", "request_footprint"]
