"""The OpenAI HTTP API in front of the slot engine (`jaxrl-scale serve`, docs/serving.md).

backend.py: what the server asks of an engine (`Request` in, `Delta`s out, `Backend`);
engine.py: `EngineBackend`, the slot engine on its own thread; protocol.py: the OpenAI schema;
text.py: a choice's text as tokens arrive; app.py: `make_app`, the FastAPI app; server.py:
uvicorn and who may connect (the command loads the policy: jaxrl_scale/serving.py).
"""

from jaxrl_scale.serve.backend import Backend, Delta, Generation, QueueFull, Request

__all__ = ["Backend", "Delta", "Generation", "QueueFull", "Request", "make_app"]


def __getattr__(name: str):
    # FastAPI is imported where an app is made, not by every process that imports the
    # engine side (a training run's trainer and generator processes).
    if name == "make_app":
        from jaxrl_scale.serve.app import make_app

        return make_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
