"""A row's text as its tokens arrive, with OpenAI's stop sequences.

The text sent so far is always a prefix of the row's final text, so a stream's pieces join into exactly the text the
same request returns whole: each piece is the difference between decodings of the token prefix, held back while the
decoding ends in U+FFFD (a multi-byte character whose bytes are split across tokens) or in the beginning of a stop
sequence. With a byte-level tokenizer (ours) the decoding of a token prefix is a prefix of the decoding of the whole
except for such a split character, which is what makes the rule exact.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Decode a growing list of token ids. `add(ids)` returns the new text that is safe to send; once a stop
    sequence appears, `stopped` is True and the text ends before it. `finish()` returns what is left to send."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped_text: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_text is not None

    def decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        if self.stopped or not ids:
            return ""
        self.tokens.extend(ids)
        text = self.decode()
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped_text = text[:min(hits)]
            return self._send(self.stopped_text, len(self.stopped_text))
        stable = text.rstrip(REPLACEMENT)  # a split character's bytes may still be completed
        held = 0  # the longest ending of the stable text that begins a stop sequence
        for length in range(min(len(stable), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(stable[-length:]) for s in self.stop):
                held = length
                break
        return self._send(text, len(stable) - held)

    def finish(self) -> str:
        """The rest of the final text (the stop-cut text, or the whole decoding)."""
        text = self.stopped_text if self.stopped else self.decode()
        return self._send(text, len(text))

    @property
    def text(self) -> str:
        return self.stopped_text if self.stopped else self.decode()

    def _send(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece
