"""llama.cpp, through llama-cpp-python: an optional dependency (the ``llama`` extra).

Training needs none of it; validating an export, K-quants, ``serve`` and chatting with a
GGUF do. llama-cpp-python has no binary wheel for every platform, and building it takes
minutes, so it is asked for only by what uses it, with one line saying how to install it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from functools import cache
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
    if cpu_has_amx() and os.environ.get(EXTRA_BUFFERS_ENV) != "1":
        _without_extra_buffers(llama_cpp)
    return llama_cpp


# llama.cpp built for an AMX CPU (a native build on Sapphire Rapids and later) multiplies quantised weights
# with AMX tile instructions, from its "extra buffer types". Some virtual machines advertise AMX and grant
# the permission to use it, yet fault on the first tile instruction: the whole process dies in
# ggml_backend_amx_mul_mat (seen on a Firecracker VM). On AMX CPUs localrl loads models without the extra
# buffer types (plain AVX-512 kernels: slower prompt processing, the same results);
# LOCALRL_LLAMA_EXTRA_BUFFERS=1 turns them back on where AMX works.
EXTRA_BUFFERS_ENV = "LOCALRL_LLAMA_EXTRA_BUFFERS"


@cache
def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def _without_extra_buffers(llama_cpp) -> None:
    """Every model llama-cpp-python loads from now on, in this process, without extra buffer types."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params
    if getattr(default, "without_extra_buffers", False) or not hasattr(default(), "use_extra_bufts"):
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    params.without_extra_buffers = True
    low.llama_model_default_params = llama_cpp.llama_model_default_params = params


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
