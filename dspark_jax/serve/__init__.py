"""OpenAI-compatible HTTP serving: ``python -m dspark_jax.serve`` (see `dspark_jax.serve.app`).

`create_app` builds the FastAPI application over an `EngineWorker` (the engine on its own thread);
`BackgroundServer` runs it with uvicorn on a thread (tests, benchmarks).
"""

from dspark_jax.serve.app import BackgroundServer, TextStream, create_app
from dspark_jax.serve.worker import EngineWorker, GenerationRequest, QueueFull, ShuttingDown

__all__ = ["create_app", "BackgroundServer", "TextStream", "EngineWorker", "GenerationRequest", "QueueFull",
           "ShuttingDown"]
