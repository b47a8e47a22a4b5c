"""The OpenAI request fields we accept, checked before any work, and the OpenAI error shape.

A field we cannot honour (``n``, ``logprobs``, penalties) is a 400 that names it, never a quietly different completion."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..files import first_line
from ..speculative.acceptance import MIN_TEMPERATURE
from ..speculative.registry import default_num_draft
from .needs import REQUEST_DRAFTERS

MAX_SEED = 2**64 - 1
MAX_JSON_DEPTH = 32  # a request is 5 levels deep (messages, parts); a deeper body is an attack on the parser, not a request
# fields OpenAI defines that would change the output; refused unless falsy (0, false, null, empty)
UNSUPPORTED = ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "tools", "functions", "presence_penalty", "frequency_penalty")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server (``serve`` flags), so that one request cannot stall the others."""

    max_num_draft: int = 16
    max_stop: int = 16
    max_stop_chars: int = 1024  # all stop strings together
    default_max_tokens: int = 1024  # chat requests that name no max_tokens (completions: OpenAI's 16)


class ApiError(Exception):
    """An HTTP error in OpenAI's JSON shape; ``message`` is one line."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

    @property
    def type(self) -> str:
        default = "server_error" if self.status >= 500 else "invalid_request_error"
        return {401: "authentication_error", 404: "not_found_error"}.get(self.status, default)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class Request:
    """One checked completion request; ``options`` are ``GenerationOptions`` fields but ``max_new_tokens``."""

    prompt: str | list[int] | list[dict[str, str]]
    chat: bool
    stream: bool
    max_tokens: int
    options: dict[str, Any]
    include_usage: bool = False


def parse_json(body: bytes) -> Any:
    """The body as JSON, or a 400: invalid, or nested deeper than ``MAX_JSON_DEPTH`` (or the parser's recursion limit)."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({first_line(exc)})") from None
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
        level = [c for v in level if isinstance(v, dict | list) for c in (v.values() if isinstance(v, dict) else v)]
    return value


def _int(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    if (value := body.get(name)) is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise bad(name, f"{name} must be an integer {bound}, got {value!r}")
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    if (value := body.get(name)) is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        raise bad(name, f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _stop(body: dict, limits: RequestLimits) -> tuple[str, ...]:
    if (stop := body.get("stop")) is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > limits.max_stop:
        raise bad("stop", f"at most {limits.max_stop} stop strings, got {len(stops)}")
    if sum(map(len, stops)) > limits.max_stop_chars:
        raise bad("stop", f"the stop strings have {sum(map(len, stops))} characters in all; the limit is {limits.max_stop_chars}")
    return tuple(stops)


def _temperature(body: dict) -> float | None:
    value = _number(body, "temperature", 0, 2)
    if value is not None and 0 < value < MIN_TEMPERATURE:
        raise bad("temperature", f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, 2], got {value!r}")
    return value


def _include_usage(body: dict) -> bool:
    """``stream_options.include_usage``, as OpenAI defines it: allowed only with ``stream``, a boolean."""
    if (options := body.get("stream_options")) is None:
        return False
    if not body.get("stream"):
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options", "stream_options must be an object with a boolean include_usage")
    return options.get("include_usage", False)


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad("prompt", "prompt must be a non-empty string or a list of token ids (one prompt per request)")


def _content(content: Any) -> str | None:
    """A message's text: a string, or OpenAI's list of parts when every part is text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    checked = []
    for m in messages:
        content = _content(m.get("content")) if isinstance(m, dict) else None
        if content is None or not isinstance(m.get("role"), str):
            raise bad("messages", "each message needs a string role and text content")
        checked.append({"role": m["role"], "content": content})
    return checked


def parse_request(body: Any, chat: bool, model: str, defaults: dict[str, Any], limits: RequestLimits = RequestLimits()) -> Request:
    """Check a JSON body for /v1/completions or (``chat``) /v1/chat/completions; ``defaults["verify"]``: default first."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model):
        raise ApiError(404, f"the model {body['model']!r} does not exist; this server serves {model!r}", "model", "model_not_found")
    if body.get("n") not in (None, 1):
        raise bad("n", f"n must be 1 (one completion per request), got {body['n']!r}")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", f"best_of must be 1, got {body['best_of']!r}")
    if (unsupported := next((name for name in UNSUPPORTED if body.get(name)), None)) is not None:
        raise bad(unsupported, f"{unsupported} is not supported by this server")
    if not isinstance(body.get("stream", False), bool):
        raise bad("stream", "stream must be true or false")
    max_tokens = (_int(body, "max_completion_tokens", 1) if chat else None) or _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = limits.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    draft = body.get("draft", defaults["draft"])
    if draft not in REQUEST_DRAFTERS:
        raise bad("draft", f"draft must be one of {', '.join(REQUEST_DRAFTERS)}, got {draft!r}")
    adaptive_k = body.get("adaptive_k")
    if adaptive_k is not None and not isinstance(adaptive_k, bool):
        raise bad("adaptive_k", f"adaptive_k must be true or false, got {adaptive_k!r}")
    if adaptive_k and draft == "none":
        raise bad("adaptive_k", "adaptive_k needs a drafter; draft 'none' drafts nothing")
    verify = body.get("verify", defaults["verify"][0])
    if verify not in defaults["verify"]:
        exact = " (exact mode needs a server started with --verify exact)" if verify == "exact" else ""
        raise bad("verify", f"verify must be one of {', '.join(defaults['verify'])} on this server, got {verify!r}{exact}")
    top_k = _int(body, "top_k", -1)
    options = {
        "temperature": _temperature(body),
        "top_p": _number(body, "top_p", 0, 1, low_open=True),
        "top_k": None if top_k is None else max(top_k, 0),  # vLLM's -1 and our 0 both mean off
        "seed": _int(body, "seed", 0, MAX_SEED),
        "stop": _stop(body, limits),
        "draft": draft,
        "num_draft": _int(body, "num_draft", 1, limits.max_num_draft) if draft != "none" else None,
        "verify": verify,
    }
    options = {name: value for name, value in options.items() if value is not None}
    options.setdefault("temperature", 1.0)  # OpenAI's default
    if draft != "none":
        # the server's --num-draft, else the drafter's own k within what a request may ask
        options.setdefault("num_draft", defaults["num_draft"] or min(default_num_draft(draft), limits.max_num_draft))
        options["adaptive_k"] = defaults["adaptive_k"] if adaptive_k is None else adaptive_k
    prompt = _messages(body) if chat else _prompt(body)
    include_usage = _include_usage(body)
    return Request(prompt, chat, body.get("stream", False), max_tokens, options, include_usage)
