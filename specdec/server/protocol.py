"""The OpenAI wire format: request bodies checked into a :class:`Parsed` request, and the
response bodies, stream chunks and error bodies the server sends.

Nothing here touches the engine or the network, so every rule is testable on plain dicts.
Parameters the server does not implement are refused unless they carry their neutral value
(``presence_penalty: 0``, ``logprobs: null`` ...), never silently ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from ..errors import RequestError
from ..sampling import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
ROLES = ("system", "developer", "user", "assistant")

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
           "stream_options", "user"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
# accepted only with the value that means "off": a client library may send them by default
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (None, False),
           "top_logprobs": (None, 0), "echo": (False,), "best_of": (1, None), "logit_bias": (None, {}),
           "suffix": (None,), "parallel_tool_calls": (None,), "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"})}


class APIError(Exception):
    """An error answered with an OpenAI error body and HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class Parsed:
    """One checked request. ``prompt`` is a text, a list of token ids, or chat messages (``chat``)."""

    chat: bool
    prompt: str | list
    max_tokens: int | None  # None: as many as the context leaves (capped by the server's limit)
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def parse_completion(body, model_name: str) -> Parsed:
    """``POST /v1/completions``: one prompt, a string or a list of token ids."""
    _check_fields(body, COMPLETION_FIELDS, model_name)
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:  # a batch of prompts
            raise bad(f"one prompt per request is supported, got {len(prompt)}; send them as separate requests",
                      "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
    elif isinstance(prompt, list):
        if not prompt or not all(_is_int(t) for t in prompt):
            raise bad("'prompt' must be a string or a non-empty list of token ids (integers)", "prompt")
    else:
        raise bad(f"'prompt' must be a string or a list of token ids, got {_kind(prompt)}", "prompt")
    return _common(body, chat=False, prompt=prompt, max_tokens=_opt_int(body, "max_tokens"))


def parse_chat(body, model_name: str) -> Parsed:
    """``POST /v1/chat/completions``: messages with roles (text content only)."""
    _check_fields(body, CHAT_FIELDS, model_name)
    msgs = body.get("messages")
    if "messages" not in body:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad(f"'messages' must be a non-empty list of messages, got {_kind(msgs)}", "messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    return _common(body, chat=True, prompt=messages, max_tokens=max_tokens)


def _message(m, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{param} must be an object with 'role' and 'content', got {_kind(m)}", param)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
    extra = set(m) - {"role", "content", "name"}
    if extra:
        raise bad(f"{param}: unsupported field(s) {', '.join(sorted(extra))} (text messages only)", param)
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{param}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                          f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise bad(f"{param}.content must be a string or a list of text parts, got {_kind(content)}",
                  f"{param}.content")
    # developer is OpenAI's newer name for system; chat templates know only system
    return {"role": "system" if role == "developer" else role, "content": content}


def _common(body: dict, *, chat: bool, prompt, max_tokens: int | None) -> Parsed:
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise bad(f"only n=1 is supported, got {n}", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"'stream' must be a boolean, got {_kind(stream)}", "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("'stream_options' must be an object with 'include_usage' only", "stream_options")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        stop = list(dict.fromkeys(stops))
    temperature = _opt_number(body, "temperature", 1.0)
    if temperature > 2:
        raise bad(f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = _opt_number(body, "top_p", 1.0)
    top_k = _opt_int(body, "top_k")
    seed = _opt_int(body, "seed")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k or 0), ("seed", seed)):
        try:  # SamplingParams owns the ranges; check each alone to name the parameter at fault
            SamplingParams(**{name: value})
        except RequestError as e:
            raise bad(str(e), name) from None
    params = SamplingParams(temperature=temperature, top_k=top_k or 0, top_p=top_p, seed=seed)
    return Parsed(chat=chat, prompt=prompt, max_tokens=max_tokens, params=params, stop=stop or [], stream=stream,
                  include_usage=include_usage)


def _check_fields(body, known: set[str], model_name: str) -> None:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}")
    for k, v in body.items():
        if k in known:
            continue
        if k in NEUTRAL:
            if not any(v == ok and type(v) is type(ok) for ok in NEUTRAL[k]):
                raise bad(f"'{k}' is not supported by this server (only {NEUTRAL[k][0]!r})", k, "unsupported_parameter")
            continue
        raise bad(f"unrecognized request argument '{k}'", k, "unrecognized_parameter")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model",
                       "model_not_found")


def _opt_int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():  # JSON writers may emit 16.0
        v = int(v)
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {_kind(v)}", name)
    return v


def _opt_number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {_kind(v)}", name)
    return float(v)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _kind(v) -> str:
    if isinstance(v, (str, bool)) or v is None:
        return repr(v)[:40]
    return {dict: "an object", list: "a list", int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


# --- responses ------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(chat: bool, rid: str, created: int, model: str, text: str, finish_reason: str,
                  use: dict) -> dict:
    """The body of a non-streamed reply."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": use}


def chunk_body(chat: bool, rid: str, created: int, model: str, *, text: str | None = None, role: bool = False,
               finish_reason: str | None = None, use: dict | None = None, include_usage: bool = False) -> dict:
    """One stream chunk: a text delta (``text``), the opening role delta (``role``), the closing
    ``finish_reason``, or (``use`` given) the usage chunk, whose ``choices`` is empty."""
    if use is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": choices}
    if include_usage:  # OpenAI sends "usage": null on every chunk but the last when usage is asked for
        out["usage"] = use
    return out


def now() -> int:
    return int(time.time())
