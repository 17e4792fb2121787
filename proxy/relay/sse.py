"""Split a Server-Sent Events byte stream into the payloads of its `data:` lines.

Chunks from the network cut events anywhere, and vLLM may pack several events into
one chunk under load; the splitter keeps the unfinished tail between calls.
"""

from __future__ import annotations

DONE = b"[DONE]"
_SEP = b"\n\n"
_DATA = b"data:"
_EVENT = b"data: "


class EventSplitter:
    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events completed by `chunk` (comments are skipped)."""
        if not self._pending and chunk.startswith(_EVENT) and chunk.endswith(_SEP) \
                and chunk.find(b"\n", 6, -2) < 0 and chunk[-3:-2] != b"\r":
            return [chunk[6:-2]]  # the usual chunk: one event of one data line
        buf = self._pending + chunk if self._pending else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        if _SEP not in buf:
            self._pending = buf
            return []
        *events, self._pending = buf.split(_SEP)
        payloads = []
        for event in events:
            if event.startswith(_EVENT) and b"\n" not in event:
                payloads.append(event[6:])  # the usual shape: one data line
                continue
            data = [line[5:].lstrip(b" ") for line in event.split(b"\n")
                    if line.startswith(_DATA)]
            if data:
                payloads.append(b"\n".join(data))
        return payloads

    @property
    def pending(self) -> bytes:
        return self._pending
