"""The terminal side of ``specdec generate`` and ``specdec chat``: streaming a reply as its tokens
are committed, and the chat loop (read a line, stream the reply, keep the history)."""

from __future__ import annotations

import sys

from .detok import TextStream


class Streamer:
    """Prints a reply while it is generated (:class:`~specdec.detok.TextStream`: a window decoded per
    push, text that is, or may still become, a stop string held back); :meth:`finish` prints
    whatever the final text (the engine's, cut before the first stop string) has beyond what was shown.
    """

    def __init__(self, tok, stop: list[str] | None = None, out=None):
        self.out = out or sys.stdout
        self.text = TextStream(tok, stop, tok.eos_ids)
        self.shown = ""

    def __call__(self, ids) -> None:
        self._write(self.text.push(ids))

    def finish(self, text: str | None) -> None:
        """Print the rest of the final reply ``text`` (the engine's, cut before any stop string)."""
        if text and len(text) > len(self.shown):
            self._write(text[len(self.shown):])

    def _write(self, s: str) -> None:
        if s:
            self.shown += s
            self.out.write(s)
            self.out.flush()


def chat_loop(llm, gen_kwargs: dict, system: str | None = None, read=input, out=None, err=None) -> int:
    """Multi-turn chat until an empty line, EOF or Ctrl-C at the prompt; returns the exit code.

    ``llm`` is an :class:`~specdec.api.LLM`, ``gen_kwargs`` the sampling arguments of
    :meth:`~specdec.api.LLM.generate` (``stop`` included). Ctrl-C while a reply streams stops
    that reply and drops the unanswered turn from the history; Ctrl-C at the prompt ends the
    chat with exit code 130.
    """
    out, err = out or sys.stdout, err or sys.stderr
    messages = [{"role": "system", "content": system}] if system else []
    print("specdec chat: empty line or Ctrl-D to quit; Ctrl-C stops a reply", file=err)
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            return 130
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        stream = Streamer(llm.tokenizer, gen_kwargs.get("stop"), out)
        try:
            res = llm.generate(messages, on_tokens=stream, **gen_kwargs)
        except KeyboardInterrupt:
            out.write("\n")
            out.flush()
            print("[reply stopped]", file=err)
            messages.pop()  # no half answers in the history
            continue
        stream.finish(res.text)
        out.write("\n")
        s = res.stats
        print(f"[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, tau {s.tau:.2f}]", file=err)
        messages.append({"role": "assistant", "content": res.text})
