"""OpenAI's response bodies and stream chunks for one request, completions and chat alike."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine import GenerationResult


def usage(result: GenerationResult) -> dict[str, int]:
    completion = len(result.tokens)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion, "total_tokens": result.prompt_tokens + completion}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {json}`` (or ``data: [DONE]``) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class Shaper:
    """Builds one request's bodies; the id and creation time are shared by every chunk of a stream, as OpenAI's are."""

    model: str
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def full(self, result: GenerationResult) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None}
            body = self._envelope("chat.completion", {**choice, "finish_reason": result.finish_reason})
        else:
            body = self._envelope(
                "text_completion", {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
            )
        return {**body, "usage": usage(result)}

    def chunk(self, text: str | None = None, result: GenerationResult | None = None, include_usage: bool = False) -> dict[str, Any]:
        """A stream chunk with new ``text`` (a chat's first, "", announces the role); the last has ``result`` instead."""
        finish = result.finish_reason if result is not None else None
        if self.chat:
            delta = {} if text is None else {"role": "assistant", "content": ""} if text == "" else {"content": text}
            body = self._envelope("chat.completion.chunk", {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})
        else:
            body = self._envelope("text_completion", {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish})
        return {**body, "usage": None} if include_usage else body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        """The chunk ``stream_options.include_usage`` asks for before ``[DONE]``: empty ``choices``, the whole request's usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", {})
        return {**body, "choices": [], "usage": usage(result)}
