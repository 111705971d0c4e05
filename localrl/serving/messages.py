"""Chat messages in every shape OpenAI's API accepts, made into the few that llama-cpp-python's request models and a
chat template take (``NormaliseMessages``), or a 400 naming the message and the field at fault.

What clients send back differs by how they build the message: the official client's returned object,
``model_dump()`` (every field, ``refusal``, ``annotations``, ``audio`` and ``function_call`` as null),
``model_dump(exclude_none=True)``, or a dict by hand. The API takes all of them, and so does this server:

- a field sent as null is a field left out;
- ``developer`` is the system role (OpenAI's newer name); a legacy ``function`` message is a ``tool`` message,
  and an assistant's legacy ``function_call`` is its one tool call;
- content given as a list of parts is their text, joined (an assistant's ``refusal`` part is text too); a part
  that is not text (an image, audio, a file) is refused: the model reads text only;
- an assistant's ``refusal`` is its content when it has none; ``annotations`` (citations) are dropped: no
  template renders them;
- a ``tool`` message's ``name`` is dropped (llama-cpp-python's model has none).

Anything else wrong (a role the API does not know, a tool call without a function name, content of the wrong
type) is ``messages[i].field: ...``, never the name of one of the request model's union branches.
"""

from __future__ import annotations

import json

from localrl.serving.asgi import CHAT, error_body, json_object, read_body, replayer, send_json

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
NEEDS_CONTENT = ("system", "user", "tool")  # (after developer and function are renamed)


class MessageError(ValueError):
    def __init__(self, where: str, text: str):
        super().__init__(f"{where}: {text}")
        self.where, self.text = where, text


def normalise(messages: list) -> list[dict]:
    """``messages`` in the shapes llama-cpp-python takes; MessageError names the first that cannot be."""
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m, where: str) -> dict:
    if not isinstance(m, dict):
        raise MessageError(where, f"must be an object with a role and content (got {_kind(m)})")
    role = m.get("role")
    if role not in ROLES:
        got = f"{role!r}" if isinstance(role, str) else ("nothing" if role is None else _kind(role))
        raise MessageError(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {got})")
    out = {k: v for k, v in m.items() if v is not None}
    if role == "developer":
        out["role"] = role = "system"
    if role == "function":  # the legacy reply to a function_call: a tool result
        name = out.pop("name", None)
        if not isinstance(name, str):
            raise MessageError(f"{where}.name", "a function message needs the name of the function it answers")
        out.update(role="tool", tool_call_id=name)
        role = "tool"
    if "content" in out:
        out["content"] = _text(out["content"], f"{where}.content", role)
    if role == "assistant":
        _assistant(out, where)
    elif "content" not in out and role in NEEDS_CONTENT:
        raise MessageError(f"{where}.content", f"a {m['role']} message needs content")
    for key in ("name", "tool_call_id"):
        if key in out and not isinstance(out[key], str):
            raise MessageError(f"{where}.{key}", f"must be a string (got {_kind(out[key])})")
    if role == "tool":
        if "tool_call_id" not in out:
            raise MessageError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out.pop("name", None)
    return out


def _assistant(out: dict, where: str) -> None:
    refusal = out.pop("refusal", None)
    if refusal is not None and not isinstance(refusal, str):
        raise MessageError(f"{where}.refusal", f"must be a string (got {_kind(refusal)})")
    if refusal and not out.get("content"):
        out["content"] = refusal
    if "audio" in out:  # an earlier spoken reply, by id: this server never gave one
        raise MessageError(f"{where}.audio", "this server has no audio replies to refer to (send null or leave it "
                                             "out)")
    annotations = out.pop("annotations", None)
    if annotations is not None and not isinstance(annotations, list):
        raise MessageError(f"{where}.annotations", f"must be a list (got {_kind(annotations)})")
    function_call = out.pop("function_call", None)
    calls = out.get("tool_calls", [])
    if not isinstance(calls, list):
        raise MessageError(f"{where}.tool_calls", f"must be a list (got {_kind(calls)})")
    if function_call is not None:
        _function(function_call, f"{where}.function_call")
        if not calls:
            calls = [{"id": function_call["name"], "type": "function", "function": function_call}]
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise MessageError(at, f"must be an object with a function (got {_kind(call)})")
        if call.get("type", "function") != "function":
            raise MessageError(f"{at}.type", f"must be 'function' (got {call.get('type')!r})")
        _function(call.get("function"), f"{at}.function")
        if not isinstance(call.get("id"), str):
            raise MessageError(f"{at}.id", f"must be a string (got {_kind(call.get('id'))})")
    if calls:
        out["tool_calls"] = [{**c, "type": "function"} for c in calls]
    else:
        out.pop("tool_calls", None)


def _function(function, where: str) -> None:
    if not isinstance(function, dict):
        raise MessageError(where, f"must be an object with a name and arguments (got {_kind(function)})")
    for key in ("name", "arguments"):
        if not isinstance(function.get(key), str):
            raise MessageError(f"{where}.{key}", f"must be a string (got {_kind(function.get(key))})")


def _text(content, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(where, f"must be a string or a list of content parts (got {_kind(content)})")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        field = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
        if field is None:
            if not isinstance(kind, str):
                raise MessageError(at, f"must be a content part with a type (got {_kind(part)})")
            raise MessageError(f"{at}.type", f"{kind!r} parts are not served: the model reads text only")
        if not isinstance(part.get(field), str):
            raise MessageError(f"{at}.{field}", f"must be a string (got {_kind(part.get(field))})")
        texts.append(part[field])
    return "\n".join(texts)


def _kind(value) -> str:
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


class NormaliseMessages:
    """ASGI middleware: a chat completion's messages normalised (``normalise``) before the other middlewares and
    llama-cpp-python read them; messages it cannot take get a 400 naming ``messages[i].field``. A body that is not
    JSON, or has no list of messages, is passed on for the request models to refuse."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("path") != CHAT:
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        request = json_object(body)
        messages = request.get("messages") if request is not None else None
        if isinstance(messages, list):
            try:
                normalised = normalise(messages)
            except MessageError as e:
                return await send_json(send, 400, error_body(str(e), param=e.where))
            if normalised != messages:
                body = json.dumps({**request, "messages": normalised}).encode()
        await self.app(scope, replayer(body, receive), send)
