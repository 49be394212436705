"""OpenAI-compatible HTTP serving: ``python -m dspark_jax.serve`` (see `dspark_jax.serve.app`).

`create_app` builds the FastAPI application over an `EngineWorker` (the engine on its own thread);
`BackgroundServer` runs it with uvicorn on a thread (tests, benchmarks); `server_config` is uvicorn's configuration
with the server's connection limits.
"""

from dspark_jax.serve.app import BackgroundServer, TextStream, create_app, server_config
from dspark_jax.serve.worker import EngineWorker, GenerationRequest, QueueFull, ShuttingDown

__all__ = ["create_app", "server_config", "BackgroundServer", "TextStream", "EngineWorker", "GenerationRequest", "QueueFull",
           "ShuttingDown"]
