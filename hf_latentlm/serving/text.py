"""A row's text as its tokens arrive, with OpenAI's stop sequences.

The text sent so far is always a prefix of the row's final text, so a stream's pieces join into exactly the text the
same request returns whole. Each step costs the same however long the row is:

- tokens are decoded in a short window (the prefix / read offsets of incremental detokenizers): the text the tokens
  after `read` add is `decode(tokens[prefix:])` minus `decode(tokens[prefix:read])`; starting a step earlier keeps
  what a decoder does at the start of a sequence (dropping a leading space) out of the difference. The window moves
  on once that text does not end in U+FFFD (a multi-byte character split across tokens), so with a byte-level
  tokenizer the pieces are exactly the decoding of the whole row;
- stop sequences are searched in the text not yet sent only: that text is held back while it ends in the beginning of
  a stop sequence, so a stop sequence never begins in text already sent.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Decode a growing list of token ids. `add(ids)` returns the new text that is safe to send; once a stop
    sequence appears, `stopped` is True, the text ends before it, and the tokens after the one that completed it are
    not taken (`tokens_used`). `finish()` returns what is left to send."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # the window's offsets in `tokens`
        self.prefix_text = ""  # decode(tokens[prefix:read])
        self.unsent = ""  # final text of tokens[:read] not sent yet
        self.pending = ""  # the text tokens[read:] add; may change while it ends in U+FFFD
        self.pending_sent = 0  # characters of `pending` already sent (its final part); then `unsent` is empty
        self.pieces: list[str] = []  # what was sent
        self.stopped = False

    @property
    def tokens_used(self) -> int:
        return len(self.tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        if self.stopped or not ids:
            return ""
        sent = len(self.pieces)
        for token in ids:
            self._take(token)
            stable = self.unsent + self.pending.rstrip(REPLACEMENT)[self.pending_sent:]
            hits = [i for i in (stable.find(s) for s in self.stop) if i >= 0]
            if hits:  # the token completed a stop sequence: nothing after it is taken
                self.stopped = True
                self._send(stable[:min(hits)])
                return "".join(self.pieces[sent:])
        held = 0  # the longest ending of the unsent final text that begins a stop sequence
        for length in range(min(len(stable), self.longest_stop - 1), 0, -1):
            if any(s.startswith(stable[-length:]) for s in self.stop):
                held = length
                break
        self._send(stable[:len(stable) - held])
        return "".join(self.pieces[sent:])

    def finish(self) -> str:
        """The rest of the final text (up to the stop sequence, or the whole decoding)."""
        if self.stopped:
            return ""
        rest = self.unsent + self.pending[self.pending_sent:]
        self._send(rest)
        return rest

    @property
    def text(self) -> str:
        """The row's text so far: what was sent, and (unless stopped) the rest of the decoding."""
        sent = "".join(self.pieces)
        return sent if self.stopped else sent + self.unsent + self.pending[self.pending_sent:]

    def _take(self, token: int) -> None:
        self.tokens.append(token)
        added = self.decode(self.tokens[self.prefix:])[len(self.prefix_text):]
        if added.endswith(REPLACEMENT):
            self.pending = added
            return
        self.unsent += added[self.pending_sent:]
        self.pending, self.pending_sent = "", 0
        self.prefix, self.read = self.read, len(self.tokens)
        self.prefix_text = self.decode(self.tokens[self.prefix:self.read])

    def _send(self, piece: str) -> None:
        """Mark `piece`, the beginning of the unsent final text, as sent."""
        if not piece:
            return
        from_unsent = min(len(piece), len(self.unsent))
        self.unsent = self.unsent[from_unsent:]
        self.pending_sent += len(piece) - from_unsent
        self.pieces.append(piece)
