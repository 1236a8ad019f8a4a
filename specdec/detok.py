"""Incremental detokenisation with stop strings, for streamed and whole replies alike (the server's
replies and the CLI's streamed output).

Each push decodes a window: the ids of the last push that completed text, then the new ones, and
appends what the new ones add to that window's text (the earlier ids give the tokenizer the context
it needs: a SentencePiece space prefix, bytes of one character split over tokens). While the ids end
inside a character nothing is added; should the new ids change how the window's earlier ones decode,
the whole reply is decoded again. A push thus costs the window, not the reply: decoding the whole
reply on every push cost 127 us a token at 2,000 tokens with SmolLM2's tokenizer (332 us with a
SentencePiece one), and 32 streams at once share one GIL with the engine. Text that is, or may
still become, a stop string is held back; only the longest tail of the text that is a prefix of
some stop string is held, so a reply without such a tail streams with no delay.
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
        self.text = ""  # the text of ids[:_read], as decoding them all gives it
        self.sent = ""
        self.stopped = False
        self._start = self._read = 0  # the window starts at ids[_start]; ids[_start:_read] decode to _read_text
        self._read_text = ""

    def _extend(self, final: bool = False) -> bool:
        """Add the text of the ids after ``_read``; False (nothing added) while they end inside a
        character, unless ``final``."""
        if self._read == len(self.ids):
            return True
        window = self.tok.decode(self.ids[self._start:])
        if window.endswith("\ufffd") and not final:  # an incomplete UTF-8 sequence: wait for the rest
            return False
        if window.startswith(self._read_text):
            self.text += window[len(self._read_text):]
        else:  # the new ids changed how the window's first ones decode
            self.text = self.tok.decode(self.ids)
        self._start, self._read = self._read, len(self.ids)
        self._read_text = self.tok.decode(self.ids[self._start:])
        return True

    def push(self, ids) -> str:
        if self.stopped:
            return ""
        self.ids.extend(i for i in ids if i not in self.skip)
        if not self._extend():
            return ""
        text = self.text
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
        self._extend(final=True)
        return self._send(self.text, None)

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
