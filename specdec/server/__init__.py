"""``specdec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the serving engine.

``protocol`` checks request bodies and shapes replies (``specdec.detok`` turns committed tokens into
text with stop strings), ``metrics`` holds the Prometheus registry, ``app`` wires them to the engine and
``run`` builds the engine and runs uvicorn. Needs the ``serve`` extra: ``pip install specdec[serve]``.
Nothing below this package imports it.
"""

__all__ = ["create_app"]


def __getattr__(name):
    # lazily: `specdec serve --help` and its argument checks must work without fastapi installed
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
