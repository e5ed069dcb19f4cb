"""`dspark-serve`: an OpenAI-compatible HTTP server over `dspark.engine.Engine`.

Installed as the import package `dspark_server` (the source lives in the repository's `server/`).
Build an app with `create_app(engine, model_name=...)` and run it under any ASGI server, or start
the whole thing with the `dspark-serve` command (`__main__.py`).
"""

from .app import create_app
from .async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app"]
