"""A model behind an OpenAI-compatible endpoint (Ollama, llama.cpp's server, ``localrl serve``, vLLM), asked
for chat completions: the judges of training-free GRPO (``experience_judge``) and of ``--reward judge:``.

A model is named ``URL|MODEL`` (``http://127.0.0.1:11434/v1|qwen2.5:7b``); without ``|MODEL`` the server's first
listed model answers, and a URL without a path gets ``/v1``. The API key, where the server wants one, comes
from the environment: ``LOCALRL_JUDGE_API_KEY``, else ``OPENAI_API_KEY``. Requests go out concurrently, at
most ``concurrency`` at a time, each with a ``timeout`` for the whole request (connecting, sending, and every byte
of the reply: a server that answers a byte a second is given up on all the same); the first look at the server
(``check``) waits at most ``CHECK_TIMEOUT_S``. Requests go straight to the server, through no proxy. A connection
failure, a time-out, a 429 or a 5xx is
retried up to ``retries`` times with a doubling pause; any other 4xx is not. Identical requests (a completion
that two group members share, a step asked again) are sent once: their replies are kept for the run. Every
request, failure, retry and cached reply is counted (``take_stats``), for the step's record; a failed request
is None, never an empty reply passed off as the judge's. ``FAILURES_IN_A_ROW`` failed requests one after another
(each after its retries) stop the run in one line naming the endpoint and its last error.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from localrl.errors import UserError

API_KEY_VARIABLES = ("LOCALRL_JUDGE_API_KEY", "OPENAI_API_KEY")
RETRY_PAUSE_S = 0.5  # before the first retry; doubled before each next one
CACHE_LIMIT = 50_000  # replies kept (a long run's worth of distinct requests)
CHECK_TIMEOUT_S = 10.0  # the first look at the server: a start that hangs on a dead endpoint says so in seconds
# requests failed one after another (each after its retries) that stop the run: a judge or world model that never
# answers is said in one line, not only counted in the records while the run trains on nothing
FAILURES_IN_A_ROW = 16


def is_endpoint(spec: str) -> bool:
    """Whether ``spec`` names a model behind an HTTP endpoint (rather than a model to load)."""
    return spec.strip().lower().startswith(("http://", "https://"))


@dataclass(frozen=True)
class EndpointSettings:
    """How an endpoint is asked: requests at a time, seconds each, retries of a failed one."""

    concurrency: int = 4
    timeout: float = 120.0
    retries: int = 2

    @classmethod
    def of(cls, cfg) -> "EndpointSettings":
        return cls(cfg.judge_concurrency, cfg.judge_timeout, cfg.judge_retries)


class _Failed(Exception):
    """A request that failed; ``retry``: whether asking again may help."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


class Endpoint:
    """Chat completions from one model of one OpenAI-compatible server. ``field``: the config field that named it
    (for error lines)."""

    def __init__(self, spec: str, field: str, settings: EndpointSettings = EndpointSettings(), role: str = "judge"):
        url, _, model = spec.strip().partition("|")
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UserError(f"config field {field}: {spec!r} is not an http(s)://HOST[:PORT][/PATH][|MODEL] endpoint",
                            field=field)
        path = parts.path.rstrip("/") or "/v1"
        self.base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        self.model, self.field, self.settings, self.role = model.strip(), field, settings, role
        self.key = next((os.environ[v] for v in API_KEY_VARIABLES if os.environ.get(v)), "")
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()
        self._checked = False
        self._stats = dict.fromkeys(("requests", "failed", "retries", "cached"), 0)
        self.last_error = ""
        self._in_a_row = 0  # requests failed since the last that was answered

    def __repr__(self) -> str:
        return f"{self.base}|{self.model}" if self.model else self.base

    # -- the server ------------------------------------------------------------------------------------------

    def check(self) -> None:
        """The server answers and serves the model (the first it lists, when none was named); else one line.
        Done once: called again, it returns at once."""
        if self._checked:
            return
        try:
            listed = self._call("GET", "/models", None, min(self.settings.timeout, CHECK_TIMEOUT_S))
        except _Failed as e:
            raise UserError(f"config field {self.field}: the {self.role} at {self.base} does not answer ({e}); start the "
                            f"server or fix the URL", field=self.field) from None
        data = listed.get("data") if isinstance(listed, dict) else None  # (a list of models; anything else: none)
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if not self.model:
            if not ids:
                raise UserError(f"config field {self.field}: {self.base} lists no model; name one as URL|MODEL",
                                field=self.field)
            self.model = ids[0]
        elif ids and self.model not in ids:
            raise UserError(f"config field {self.field}: {self.base} does not serve {self.model!r} (it lists "
                            f"{', '.join(map(str, ids[:8]))})", field=self.field)
        self._checked = True

    def chat(self, requests: list[list[dict]], max_tokens: int) -> list[str | None]:
        """Each request's reply (its messages answered greedily, at most ``max_tokens`` tokens); None for one that
        failed after its retries (``last_error`` says how)."""
        self.check()
        keys = [json.dumps([self.model, max_tokens, r], sort_keys=True) for r in requests]
        with self._lock:
            missing = list(dict.fromkeys(k for k in keys if k not in self._cache))
            self._stats["cached"] += len(keys) - len(missing)  # (a request repeated within the call counts too)
        messages = {k: r for k, r in zip(keys, requests)}
        if missing:
            with ThreadPoolExecutor(max_workers=max(1, min(self.settings.concurrency, len(missing)))) as pool:
                replies = list(pool.map(lambda k: self._ask(messages[k], max_tokens), missing))
            with self._lock:
                if len(self._cache) + len(missing) > CACHE_LIMIT:
                    self._cache.clear()
                self._cache.update({k: r for k, r in zip(missing, replies) if r is not None})
                failed = {k for k, r in zip(missing, replies) if r is None}
                for reply in replies:
                    self._in_a_row = 0 if reply is not None else self._in_a_row + 1
                in_a_row = self._in_a_row
            if in_a_row >= FAILURES_IN_A_ROW:
                raise UserError(f"config field {self.field}: the {self.role} at {self!r} failed {in_a_row} requests "
                                f"in a row, each after {self.settings.retries} retries (the last: "
                                f"{self.last_error}); stopping rather than going on without it", field=self.field)
        else:
            failed = set()
        return [None if k in failed else self._cache.get(k) for k in keys]

    def take_stats(self, prefix: str = "") -> dict[str, int]:
        """The counts since the last call: requests sent (retries apart), failed, retries, answered from the cache;
        each name after ``prefix``."""
        with self._lock:
            stats, self._stats = self._stats, dict.fromkeys(self._stats, 0)
        return {prefix + k: v for k, v in stats.items()}

    # -- one request -----------------------------------------------------------------------------------------

    def _ask(self, messages: list[dict], max_tokens: int) -> str | None:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
        with self._lock:
            self._stats["requests"] += 1
        for attempt in range(self.settings.retries + 1):
            try:
                reply = self._call("POST", "/chat/completions", body, self.settings.timeout)
                content = reply["choices"][0]["message"].get("content")
                if not isinstance(content, str):
                    raise _Failed("a reply without text content", retry=False)
                return content
            except (KeyError, IndexError, TypeError):
                error = _Failed("a reply that is not a chat completion", retry=False)
            except _Failed as e:
                error = e
            self.last_error = str(error)
            if not error.retry or attempt == self.settings.retries:
                break
            with self._lock:
                self._stats["retries"] += 1
            time.sleep(RETRY_PAUSE_S * 2 ** attempt)
        with self._lock:
            self._stats["failed"] += 1
        return None

    def _call(self, method: str, path: str, body: dict | None, timeout: float):
        """One request's parsed JSON reply, given at most ``timeout`` seconds in all; else ``_Failed``."""
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.key}"} if self.key else {})
        data = None if body is None else json.dumps(body).encode()
        parts = urllib.parse.urlsplit(self.base + path)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=timeout)
        expired = threading.Event()

        def expire() -> None:  # wakes a read blocked on a server that sends its reply a byte at a time
            expired.set()
            if connection.sock is not None:
                try:
                    connection.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(timeout, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), data, headers)
            response = connection.getresponse()
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise _Failed(f"no whole reply within {timeout:g} s", retry=True) from None
            raise _Failed(str(e) or type(e).__name__, retry=True) from None
        finally:
            watchdog.cancel()
            connection.close()
        if expired.is_set():
            raise _Failed(f"no whole reply within {timeout:g} s", retry=True)
        text = raw.decode("utf-8", "replace")
        if status >= 400:
            detail = _error_message(text)
            raise _Failed(f"HTTP {status}{': ' + detail if detail else ''}", retry=status == 429 or status >= 500)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise _Failed("a reply that is not JSON", retry=False) from None


def _error_message(text: str) -> str:
    """The message of an OpenAI-style JSON error body, on one line (empty if there is none)."""
    try:
        payload = json.loads(text)
        message = payload.get("error", {}).get("message", "") if isinstance(payload.get("error"), dict) \
            else str(payload.get("error") or payload.get("detail") or "")
    except (ValueError, AttributeError):
        return ""
    return " ".join(str(message).split())[:200]
