"""The server's bounds on what one request may make it parse, each a ``localrl serve`` flag with a default.

llama.cpp parses a request's grammar recursively, in C++: 20,000 nested parentheses or 190,000 rules that each
name the next overflow its stack and kill the whole process, whoever else it was serving. Each stop string is
checked against the text after every token, so 300,000 of them make a 100-token reply take seconds while other
requests wait. A request head of 100 MiB, or one sent a byte at a time, holds a connection and the parser. So
before llama.cpp sees a request, its grammar (and a JSON schema it would turn into one), stop list and logit
bias are measured, and the HTTP layer bounds the head's size, header count and the time it may take to arrive
(``bounded_http``). A request over a bound gets a 4xx naming the bound and its flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from localrl.config_io import flag_name


@dataclass(frozen=True)
class RequestLimits:
    max_grammar_bytes: int = 64 * 1024  # a hand-written GBNF grammar is a few KB
    max_grammar_depth: int = 64  # parentheses within each other in a grammar
    max_grammar_rules: int = 1024  # rules in a grammar, and $refs in a JSON schema
    max_stops: int = 16  # stop strings a request (OpenAI allows 4)
    max_stop_chars: int = 1024  # characters a stop string
    max_logit_bias: int = 1024  # logit_bias entries a request
    max_header_bytes: int = 64 * 1024  # a request line and its headers together
    max_headers: int = 100  # headers a request
    header_timeout: float = 1.0  # seconds a request's line and headers may take from their first byte
    idle_timeout: float = 10.0  # seconds a connection may wait before it sends a request

    HELP = {"max_grammar_bytes": "largest grammar (GBNF) or JSON schema a request may send, in bytes",
            "max_grammar_depth": "deepest nesting of parentheses in a grammar",
            "max_grammar_rules": "most rules in a grammar (and $refs in a JSON schema)",
            "max_stops": "most stop strings in a request",
            "max_stop_chars": "longest stop string, in characters",
            "max_logit_bias": "most logit_bias entries in a request",
            "max_header_bytes": "largest request line and headers together, in bytes",
            "max_headers": "most headers in a request",
            "header_timeout": "seconds a request's line and headers may take to arrive, from their first byte",
            "idle_timeout": "seconds a connection may stay open without sending a request"}

    def check(self) -> None:
        """Every bound positive and finite, or a ValueError naming its flag."""
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"{flag_name(f.name)} must be a positive number (got {value})")

    def problem(self, request: dict) -> tuple[str, str] | None:
        """(parameter, message) for the first bound a completion request passes, or None."""
        grammar = request.get("grammar")
        if isinstance(grammar, str) and grammar:
            if len(grammar.encode()) > self.max_grammar_bytes:
                return "grammar", self._over("max_grammar_bytes", f"{len(grammar.encode())} bytes")
            rules, depth = grammar_shape(grammar)
            if rules > self.max_grammar_rules:
                return "grammar", self._over("max_grammar_rules", f"{rules} rules")
            if depth > self.max_grammar_depth:
                return "grammar", self._over("max_grammar_depth", f"parentheses {depth} deep")
        schema = _response_schema(request.get("response_format"))
        if schema is not None:
            text = json.dumps(schema)
            if len(text.encode()) > self.max_grammar_bytes:
                return "response_format", self._over("max_grammar_bytes", f"a {len(text.encode())}-byte schema")
            if text.count('"$ref"') > self.max_grammar_rules:
                return "response_format", self._over("max_grammar_rules", f"{text.count(chr(34) + '$ref')} $refs")
        stop = request.get("stop")
        stops = [stop] if isinstance(stop, str) else (stop if isinstance(stop, list) else [])
        if len(stops) > self.max_stops:
            return "stop", self._over("max_stops", f"{len(stops)} stop strings")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > self.max_stop_chars:
            return "stop", self._over("max_stop_chars", f"a stop string of {longest} characters")
        bias = request.get("logit_bias")
        if isinstance(bias, dict) and len(bias) > self.max_logit_bias:
            return "logit_bias", self._over("max_logit_bias", f"{len(bias)} entries")
        return None

    def _over(self, name: str, got: str) -> str:
        return f"over the server's limit of {getattr(self, name)} ({name}, its {flag_name(name)}; got {got})"


def _response_schema(response_format) -> dict | None:
    """The JSON schema a response_format asks llama-cpp-python to turn into a grammar, if any."""
    if not isinstance(response_format, dict):
        return None
    schema = response_format.get("schema")
    if schema is None and isinstance(response_format.get("json_schema"), dict):
        schema = response_format["json_schema"].get("schema", response_format["json_schema"])
    return schema if isinstance(schema, (dict, list)) else None


def grammar_shape(grammar: str) -> tuple[int, int]:
    """(rules, deepest parenthesis nesting) of a GBNF grammar, read as llama.cpp reads it: ``::=`` and parentheses
    inside a quoted literal, a character class or a comment do not count. Iterative, one pass."""
    rules = depth = deepest = 0
    i, n = 0, len(grammar)
    while i < n:
        ch = grammar[i]
        if ch in "\"[":  # a literal or a class: to its unescaped end
            close = '"' if ch == '"' else "]"
            i += 1
            while i < n and grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
        elif ch == "#":  # a comment: to the end of the line
            while i < n and grammar[i] not in "\r\n":
                i += 1
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
        elif grammar.startswith("::=", i):
            rules += 1
            i += 2
        i += 1
    return rules, deepest
