"""``specdec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the serving engine.

``protocol`` checks request bodies and shapes replies, ``detok`` turns committed tokens into text
with stop strings, ``metrics`` holds the Prometheus registry, ``app`` wires them to the engine and
``run`` builds the engine and runs uvicorn. Needs the ``serve`` extra: ``pip install specdec[serve]``.
Nothing below this package imports it.
"""

from .app import create_app

__all__ = ["create_app"]
