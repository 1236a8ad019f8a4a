"""Incremental detokenisation with stop strings, for streamed and whole replies alike.

Like :class:`specdec.chat.Streamer`, it decodes the whole reply on every push and sends the new
suffix, so a token that completes a multi-byte character (or changes how its neighbours decode)
is handled by the tokenizer, not here. Text that is, or may still become, a stop string is held
back; only the longest tail of the text that is a prefix of some stop string is held, so a reply
without such a tail streams with no delay.
"""

from __future__ import annotations


class TextStream:
    """Feed committed token ids with :meth:`push`; it returns the text that may be sent now.

    ``skip_ids`` (end-of-sequence tokens) never appear in the text. After a push returns with
    :attr:`stopped` set, the text sent so far is the reply cut before the first stop string.
    """

    def __init__(self, tok, stop: list[str] | None = None, skip_ids=()):
        self.tok, self.stop, self.skip = tok, list(stop or []), set(skip_ids)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, ids) -> str:
        if self.stopped:
            return ""
        self.ids.extend(i for i in ids if i not in self.skip)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return ""
        # a stop string can only start in the unsent part or in the held tail just before it
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._send(text, min(hits))
        return self._send(text, len(text) - self._held(text))

    def flush(self) -> str:
        """At the end of the reply: the held-back text (it never became a stop string)."""
        if self.stopped:
            return ""
        return self._send(self.tok.decode(self.ids), None)

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop string starts with."""
        for n in range(min(len(text), max((len(s) - 1 for s in self.stop), default=0)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _send(self, text: str, upto: int | None) -> str:
        text = text if upto is None else text[:upto]
        if len(text) <= len(self.sent):
            return ""
        new = text[len(self.sent):]
        self.sent = text
        return new
