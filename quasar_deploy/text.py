"""Text around the token ids: input checked before the tokenizer sees it, output decoded token by token without
splitting a character, and cut at stop strings. The engine's generations use these; the speculative loop knows only ids."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import QuasarError


def check_text(text: str, what: str) -> None:
    """Text the tokenizer can encode: a lone surrogate (undecodable bytes on a command line, or from Python) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise QuasarError(f"{what} is not valid UTF-8 text (character {exc.start} is a lone surrogate)") from None


class Detokenizer:
    """Decodes token by token without splitting a multi-byte character across pieces: a short window (the tail shown
    plus the new tokens) keeps a step O(1) and gives the tokenizer context; a partial character is held back."""

    def __init__(self, tokenizer, prompt: Sequence[int], context: int = 6):
        self.tokenizer = tokenizer
        self.ids = list(prompt[-context:])
        self.shown = 0  # window start: tokens before it are done with
        self.read = len(self.ids)  # tokens before it have been turned into text

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self) -> str:
        before = self._text(self.ids[self.shown : self.read])
        after = self._text(self.ids[self.shown :])
        return after[len(before) :] if len(after) > len(before) else ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        if not (piece := self._new_text()) or piece.endswith("\ufffd"):
            return ""
        self.shown, self.read = self.read, len(self.ids)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        piece = self._new_text()
        self.shown = self.read = len(self.ids)
        return piece


class StopStrings:
    """Cuts the text before the first stop string, holding back any tail that might become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.held = tuple(stops), ""

    def push(self, piece: str) -> tuple[str, bool]:
        """The text now safe to show, and whether a stop string was reached."""
        if not self.stops:
            return piece, False
        text = self.held + piece
        if hits := [i for i in (text.find(s) for s in self.stops) if i >= 0]:
            self.held = ""
            return text[: min(hits)], True
        safe = next((i for i in range(len(text)) if any(s.startswith(text[i:]) for s in self.stops)), len(text))
        self.held = text[safe:]
        return text[:safe], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
