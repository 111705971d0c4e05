"""What a request must pass before any part of the server reads its body (``Gate``, the first middleware): the Host
header, the CORS origins, the API key, the body's size and its JSON nesting; and where the key comes from
(``api_key_from``, ``read_secret_file``) and which Host names a bound address serves (``served_hosts``)."""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from localrl.errors import UserError
from localrl.serving.asgi import error_body, header, read_body, replayer, send_json
from localrl.serving.limits import RequestLimits

MAX_BODY_BYTES = 4 * 1024 * 1024  # a request's body; a whole 32k-token chat is some 200 KB of JSON
MAX_JSON_DEPTH = 64  # arrays and objects within each other in a request; a tool's JSON schema needs a dozen
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})  # the Host names of a loopback server
API_KEY_ENV = "LOCALRL_API_KEY"
MAX_KEY_FILE_BYTES = 4096  # a key file holds one key


class Gate:
    """ASGI middleware, the first to see a request: what the request must pass before any part of the server reads
    its body. In order:

    - its Host header names this server (else a 403): a web page that a DNS rebinding points at this address sends
      its own domain name. Served: the ``--host`` address, ``localhost``, ``127.0.0.1`` and ``[::1]`` for a loopback
      or wildcard bind, any IP address for a wildcard bind (a page sends one only when it came from this server),
      and the ``--allowed-host`` names;
    - the CORS headers and preflight answers of the ``--cors-origin`` origins, and for no other origin (by default
      none: no web page may read the server's answers or send it JSON);
    - the API key (else a 401, the body unread);
    - a body of at most ``max_body`` bytes (else a 413: at once for a Content-Length over it, and a chunked body is
      cut off as it passes the limit; the rest is never read into memory);
    - JSON nested at most MAX_JSON_DEPTH deep (else a 400, before any parser recurses into it).

    The body, read once and whole, is handed on to the app.
    """

    def __init__(self, app, hosts: frozenset[str], any_address: bool, api_key: str | None,
                 max_body: int = MAX_BODY_BYTES, cors_origins: tuple[str, ...] = (),
                 max_headers: int = RequestLimits.max_headers) -> None:
        self.app, self.hosts, self.any_address, self.api_key, self.max_body = app, hosts, any_address, api_key, max_body
        self.max_headers = max_headers
        self.admit = self._admit
        if cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            self.admit = CORSMiddleware(self._admit, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                        allow_headers=["Authorization", "Content-Type"])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if len(scope.get("headers") or []) > self.max_headers:
            return await send_json(send, 431, error_body(
                f"headers: over the server's limit of {self.max_headers} (max_headers, its --max-headers; got "
                f"{len(scope['headers'])})", code="headers_too_large"))
        host = header(scope, b"host")  # (HTTP/1.0 may leave it out; a browser never does)
        if host is not None and not self.host_allowed(host):
            name = host_name(host)
            return await send_json(send, 403, error_body(
                f"Host {name!r} is not served here (start the server with --allowed-host {name} to serve it)",
                code="host_not_allowed"))
        await self.admit(scope, receive, send)

    def host_allowed(self, header: str) -> bool:
        name = host_name(header)
        return name in self.hosts or (self.any_address and _address(name) is not None)

    def authorized(self, scope) -> bool:
        """Whether the request carries the key: ``Authorization: Bearer KEY``, the scheme in any case (RFC 7235)."""
        if not self.api_key:
            return True
        scheme, _, credentials = (header(scope, b"authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode("latin-1"),
                                                                  self.api_key.encode("latin-1", "replace"))

    async def _admit(self, scope, receive, send) -> None:
        if not self.authorized(scope):
            return await send_json(send, 401, error_body("invalid API key (send Authorization: Bearer KEY)",
                                                      code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        length = header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            return await self._too_large(send)
        body = await read_body(receive, self.max_body)
        if body is None:
            return await self._too_large(send)
        if _nests_deeper(body, MAX_JSON_DEPTH):
            return await send_json(send, 400, error_body(f"body: JSON nested more than {MAX_JSON_DEPTH} levels deep",
                                                      param="body"))
        await self.app(scope, replayer(body, receive), send)

    async def _too_large(self, send) -> None:
        # what the client still sends uvicorn reads and drops (it keeps nothing), so a client that sends the whole
        # body before it reads the answer gets the 413; uvicorn closes the connection instead if the request said
        # "Connection: close"
        message = f"body: over the server's limit of {self.max_body} bytes (its --max-body-bytes)"
        await send_json(send, 413, error_body(message, param="body", code="request_too_large"))


_BRACKETS = np.isin(np.arange(256), list(b"[]{}"))  # [256]: whether a byte is a bracket


def json_depth(body: bytes) -> int:
    """How deeply a JSON text nests arrays and objects (brackets inside strings do not count), found without
    recursion: Python's parser recurses once a level, so 100,000 ``[`` raise a RecursionError in it. Vectorised:
    a quote is escaped when an odd run of backslashes ends right before it, a bracket is in a string when an odd
    number of unescaped quotes comes before it."""
    text = np.frombuffer(body, np.uint8)
    quotes, slashes = np.flatnonzero(text == ord('"')), np.flatnonzero(text == ord("\\"))  # [positions]
    if len(quotes) and len(slashes):
        new_run = np.ones(len(slashes), bool)
        new_run[1:] = slashes[1:] != slashes[:-1] + 1
        starts, ends = slashes[new_run], slashes[np.append(new_run[1:], True)]  # [backslash runs]
        run = np.minimum(np.searchsorted(ends, quotes - 1), len(ends) - 1)  # the run that may end before each quote
        quotes = quotes[~((ends[run] == quotes - 1) & ((quotes - starts[run]) % 2 == 1))]
    brackets = np.flatnonzero(_BRACKETS[text])
    if len(quotes):
        brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # outside strings
    steps = np.where(text[brackets] & 2, 1, -1)  # +1 opens, -1 closes: of the four, only "[" and "{" have bit 2 set
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def _nests_deeper(body: bytes, limit: int) -> bool:
    if body.count(b"[") + body.count(b"{") <= limit:  # it cannot: the usual request is done here
        return False
    return json_depth(body) > limit


def host_name(header: str) -> str:
    """The host in a Host header: lower case, without the port, an IPv6 address without its brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:header.find("]")] if "]" in header else header
    else:
        name = header.rpartition(":")[0] if ":" in header else header
    return name.rstrip(".")


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``name`` as an IP address (an IPv6 one with or without brackets), or None if it is not one."""
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def _is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every address: ``0.0.0.0``, ``::``."""
    address = _address(host)
    return host in ("", "*") or (address is not None and address.is_unspecified)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on this machine only."""
    address = _address(host)
    return host.lower() == "localhost" or (address is not None and address.is_loopback)


def served_hosts(host: str, allowed: tuple[str, ...] = ()) -> tuple[frozenset[str], bool]:
    """The names a Host header may give to a server bound to ``host``, and whether any IP address is one too."""
    names = {host_name(f"[{host.strip('[]')}]" if ":" in host else host), *(host_name(a) for a in allowed)}
    wildcard = _is_wildcard(host)
    if wildcard or is_loopback(host):
        names |= LOOPBACK_NAMES
    return frozenset(names), wildcard


def cors_origin(origin: str) -> str:
    """A --cors-origin as browsers send it in an Origin header, or a UserError."""
    parts = urllib.parse.urlsplit(origin.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment \
            or "@" in parts.netloc:
        raise UserError(f"serve --cors-origin {origin!r}: must be one origin, scheme://host[:port], such as "
                        "http://localhost:3000")
    return f"{parts.scheme}://{parts.netloc.lower()}"


def read_secret_file(path: str | Path, where: str, warn: Callable[[str], Any] = print) -> str:
    """The text of a file that holds a secret: a regular file (a FIFO would block, a device never end) of at most
    ``MAX_KEY_FILE_BYTES``, opened without blocking; a warning if other users may read it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{where}: not a regular file (a FIFO, device or directory cannot hold a key)")
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise UserError(f"{where}: {st.st_size} bytes; a key file holds one key (at most {MAX_KEY_FILE_BYTES})")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        warn(f"warning: {where} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); "
             f"chmod 600 {path}")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UserError(f"{where}: not text") from None


def api_key_from(key: str | None = None, key_file: str | Path | None = None,
                 environ: Mapping[str, str] | None = None, warn: Callable[[str], Any] = print) -> str | None:
    """The API key to require: ``key``, else the contents of ``key_file`` (``read_secret_file``), else
    $LOCALRL_API_KEY, else None."""
    if key is not None and key_file is not None:
        raise UserError("serve: give --api-key or --api-key-file, not both")
    where = "--api-key"
    if key_file is not None:
        where = f"--api-key-file {key_file}"
        key = read_secret_file(key_file, f"serve {where}", warn).strip()
    elif key is None:
        key, where = (os.environ if environ is None else environ).get(API_KEY_ENV) or None, API_KEY_ENV
        if key is None:
            return None
    key = key.strip()
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise UserError(f"serve {where}: the key must be one word of printable ASCII (got {len(key)} characters)")
    return key
