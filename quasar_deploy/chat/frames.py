"""Messages between the server's process and its chat-template renderer: a tag, a length, then that many bytes.

``FrameReader`` refuses a length past its limit before buffering anything: a length field never makes it allocate."""

from __future__ import annotations

import os
import struct

HEADER = struct.Struct("!IQ")  # tag (0: setup; else a request's id), payload length
SETUP = 0


def reply_limit(max_chars: int) -> int:
    """The largest reply a render may send: a token per UTF-8 byte (4 a character), 12 bytes an id, or an error line."""
    return 4 * 12 * max_chars + (1 << 16)


class FrameError(Exception):
    """A frame longer than its reader accepts."""


def frame(tag: int, payload: bytes) -> bytes:
    """One frame's bytes, ready to write."""
    return HEADER.pack(tag, len(payload)) + payload


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to the file descriptor (a pipe takes a large write in pieces)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Frames out of a byte stream, each at most ``limit`` bytes of payload."""

    def __init__(self, limit: int):
        self.limit, self._buffer = limit, bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames that ``data`` completes, in order, as (tag, payload)."""
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            tag, length = HEADER.unpack_from(self._buffer)
            if length > self.limit:
                raise FrameError(f"a message of {length} bytes, over the limit of {self.limit}")
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append((tag, bytes(self._buffer[HEADER.size : end])))
            del self._buffer[:end]
        return frames
