"""llama.cpp, through llama-cpp-python: an optional dependency (the ``llama`` extra).

Training needs none of it; validating an export, K-quants, ``serve`` and chatting with a
GGUF do. llama-cpp-python has no binary wheel for every platform, and building it takes
minutes, so it is asked for only by what uses it, with one line saying how to install it.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from localrl.errors import UserError

INSTALL = "pip install 'localrl[llama]'"


def require_llama_cpp(what: str):
    """The ``llama_cpp`` module, or a UserError naming ``what`` needs it and how to install it.
    llama.cpp's own log (every debug line, unless the application set a level) is cut to errors, as
    llama-cpp-python's ``verbose=False`` does (some of its informational lines come at warning level)."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError(f"{what} needs llama-cpp-python, which is not installed ({INSTALL})") from None
    logger = logging.getLogger("llama-cpp-python")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)
    return llama_cpp


@contextmanager
def quiet() -> Iterator[None]:
    """Silence llama.cpp's log lines (llama-cpp-python routes them through this logger) meanwhile."""
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def require_llama_cpp_server(what: str):
    """llama-cpp-python's server extras (FastAPI, uvicorn), or a UserError saying how to install them."""
    require_llama_cpp(what)
    try:
        import uvicorn  # noqa: F401
        from llama_cpp.server import app
    except ImportError:
        raise UserError(f"{what} needs llama-cpp-python's server extras ({INSTALL})") from None
    return app
