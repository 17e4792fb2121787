"""What a tracked request has generated so far, across every backend it ran on.

The proxy, not the backend, decides what text the client sees of a tracked request:
backends are asked to include stop strings in their output (so they hold nothing
back), and the proxy holds back the last `max(len(stop)) - 1` characters itself, as
vLLM would. That way a stop string that straddles a migration splice (its first
characters from backend A, the rest from backend B) still stops the generation.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.migration.event_pieces import Piece


@dataclass(slots=True)  # not frozen: once per token, as Piece
class Release:
    """What one upstream piece lets the client see."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Generation:
    def __init__(self, stops: tuple[str, ...] = (), include_stop: bool = False,
                 tokenizer: str = "", min_tokens: int = 0) -> None:
        self.prompt_token_ids: list[int] | None = None  # as the first backend counted them
        self.token_ids: list[int] = []  # every generated id, on every backend
        # Continuing elsewhere: `_base + token_ids[_since:]` are the sequence's ids in
        # the vocabulary of `tokenizer` (re-based when a move changes tokenizer), the
        # generated ones from `_base[_output_from]` on.
        self.tokenizer = tokenizer
        self._base: list[int] | None = None
        self._since = 0
        self._output_from = 0
        self.text_parts: list[str] = []  # released text, for a non-streamed answer
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.fingerprint: str | None = None
        self._stops = stops
        self._include_stop = include_stop
        self._hold = max(map(len, stops)) - 1 if stops and not include_stop else 0
        self._lookback = max(map(len, stops), default=1) - 1
        self._pending = ""  # received, not yet released
        self._released_tail = ""  # the last `_lookback` released characters
        self.clean_boundary = True  # the text so far decodes completely (splice here)
        # The last token boundary known to decode completely, and the text received up
        # to it (`since_clean`): a continuation must not start inside a character.
        self.clean_at = 0
        self._clean_received = 0
        self._trimmed = 0
        # As vLLM: no stop string counts before `min_tokens` tokens, nor one that ends
        # within their text (it ends at character `_stops_from`, once known).
        self._min_tokens = min_tokens
        self._stops_from: int | None = 0 if min_tokens <= 0 else None
        self._received = 0  # characters of text received

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        """Everything generated so far, released or held back."""
        return "".join(self.text_parts) + self._pending

    def sequence_ids(self) -> list[int]:
        """Prompt + generated ids in `tokenizer`'s vocabulary: what a continuation sends."""
        base = self._base if self._base is not None else self.prompt_token_ids or []
        return base + self.token_ids[self._since:]

    @property
    def output_from(self) -> int:
        """Where the generated ids begin in `sequence_ids()`."""
        return self._output_from if self._base is not None else len(
            self.prompt_token_ids or ())

    def rebase(self, sequence_ids: list[int], tokenizer: str, output_from: int) -> None:
        """The sequence re-tokenized for another tokenizer (a move across tokenizers),
        its generated ids from `output_from` on."""
        self._base, self._since, self.tokenizer = sequence_ids, len(self.token_ids), tokenizer
        self._output_from = output_from
        self.clean_at, self._clean_received = self._since, self._received  # from text

    @property
    def since_clean(self) -> tuple[int, int]:
        """(tokens, characters of text) generated since `clean_at`.

        vLLM streams a token's text once the text decodes completely, so a piece of one
        token with text ends at a clean boundary; and a piece whose text begins with an
        ASCII character begins at one (a character left incomplete before it would come
        first). A piece packing several tokens (vLLM behind, or `--stream-interval`) may
        end inside a character, whatever its text: then only the backend can tell."""
        return len(self.token_ids) - self.clean_at, self._received - self._clean_received

    def add(self, piece: Piece) -> Release:
        if piece.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = piece.prompt_token_ids
        if piece.fingerprint is not None:
            self.fingerprint = piece.fingerprint
        ids, text = piece.token_ids, piece.text
        if text and text[0] < "\x80":
            self.clean_at, self._clean_received = len(self.token_ids), self._received
        self.token_ids += ids
        self.clean_boundary = bool(text) and not text.endswith("\ufffd")
        self._pending += text
        self._received += len(text)
        if self.clean_boundary and len(ids) == 1:
            self.clean_at, self._clean_received = len(self.token_ids), self._received
        if self._stops_from is None and len(self.token_ids) >= self._min_tokens:
            self._stops_from = self._text_end_of(self._min_tokens, piece)
        if self._stops and len(self.token_ids) > self._min_tokens \
                and (hit := self._find_stop()) is not None:
            return self._stop_at(*hit, piece)
        if piece.finish_reason is not None:
            return self._finish(piece, ids)
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return Release("", ids)
        return Release(self._release(self._pending[:cut], self._pending[cut:]), ids)

    def _text_end_of(self, tokens: int, piece: Piece) -> int:
        """Where the text of the first `tokens` generated tokens ends: in `piece`, which
        completed them (proportionally when it packs several, as `_trim_past_stop`)."""
        ids, text = piece.token_ids, piece.text
        before = len(self.token_ids) - len(ids)
        start = self._received - len(text)
        if len(ids) <= 1:
            return self._received
        return start + len(text) * (tokens - before) // len(ids)

    def _find_stop(self) -> tuple[int, str] | None:
        """The stop string that completes first in the unreleased text (ties: the
        earlier in the list, as vLLM), and where it starts relative to it."""
        window = self._released_tail + self._pending
        assert self._stops_from is not None
        since = self._stops_from - (self._received - len(window))  # in `window`
        best: tuple[int, int, int] | None = None  # (end, list order, start)
        for order, stop in enumerate(self._stops):
            at = window.find(stop, max(0, since - len(stop) + 1))  # ends past `since`
            if at >= 0 and (best is None or (at + len(stop), order) < best[:2]):
                best = (at + len(stop), order, at)
        if best is None:
            return None
        return best[2] - len(self._released_tail), self._stops[best[1]]

    def _stop_at(self, at: int, stop: str, piece: Piece) -> Release:
        end = at + len(stop) if self._include_stop else at
        self._trim_past_stop(piece, at + len(stop))
        text = self._release(self._pending[:max(end, 0)], "")
        self.finish_reason, self.stop_reason = "stop", stop
        return Release(text, piece.token_ids[:len(piece.token_ids) - self._trimmed], "stop",
                       stop)

    def _trim_past_stop(self, piece: Piece, stop_end: int) -> None:
        """Drop the ids generated after the token completing the stop string, as vLLM
        does. A piece may pack several tokens whose text boundaries are unknown here, so
        the count kept is proportional to the piece's text up to the stop's end."""
        self._trimmed = 0
        ids, text = piece.token_ids, piece.text
        piece_start = len(self._pending) - len(text)
        inside = stop_end - piece_start  # characters of this piece up to the stop's end
        if len(ids) > 1 and text and 0 < inside < len(text):
            keep = max(1, -(-len(ids) * inside // len(text)))
            self._trimmed = len(ids) - keep
            del self.token_ids[len(self.token_ids) - self._trimmed:]

    def _finish(self, piece: Piece, ids: list[int]) -> Release:
        text = self._pending
        stop = piece.stop_reason
        if isinstance(stop, str) and not self._include_stop and text.endswith(stop):
            text = text[: -len(stop)]  # the backend included it because we asked it to
        self.finish_reason, self.stop_reason = piece.finish_reason, stop
        return Release(self._release(text, ""), ids, piece.finish_reason, stop)

    def _release(self, text: str, keep: str) -> str:
        self._pending = keep
        if text:
            self.text_parts.append(text)
            if self._lookback:
                self._released_tail = (self._released_tail + text)[-self._lookback:]
        return text
