"""SentencePiece-style GGUF vocabularies: ``tokenizer.ggml.model = "llama"`` (Llama 2, Gemma 3 ...)
and ``"gemma4"`` (Gemma 4).

The ``llama`` encoder follows llama.cpp's ``llm_tokenizer_spm`` so ids equal llama.cpp's:

1. Special-token text is split out first, longest token first: control, user-defined and unknown
   tokens (``tokenizer.ggml.token_type`` 3, 4, 2). User-defined tokens such as Gemma's ``"\\n\\n"``
   therefore always come out whole.
2. Each remaining fragment gets a leading space when ``add_space_prefix`` is set and it starts
   the text or follows a special token; spaces become ``"▁"``.
3. The fragment starts as one symbol per character; the adjacent pair whose concatenation is a
   token with the highest score is merged (ties: the leftmost pair), until no pair is a token.
4. A symbol that is not a token (a character outside the vocabulary) is emitted as its UTF-8
   bytes, ``<0xNN>`` tokens (byte fallback).

Decoding turns ``"▁"`` back into spaces, byte tokens into bytes, renders control tokens unless
special tokens are skipped, and drops the one space ``add_space_prefix`` put in front.

``gemma4`` is what llama.cpp calls SentencePiece-style BPE (:class:`SpmBpeTokenizer`): a BPE
vocabulary (``tokenizer.ggml.merges``) over raw UTF-8 with ``"▁"`` for spaces and ``<0xNN>`` byte
fallback. It differs from the above in three places only: step 3 merges the adjacent pair with the
lowest merge rank (the pair's position in ``tokenizer.ggml.merges``, not the score of its
concatenation; ties: the leftmost pair); each fragment is first cut into runs of newlines and
runs of everything else, which merge separately; and a run of newlines that is itself a token is
emitted whole. There is never a space prefix, and BOS is always added.

:class:`SpmTokenizer` offers the few methods of ``tokenizers.Tokenizer`` that
:class:`specdec.tokenizer.Tokenizer` calls, so both kinds sit behind one wrapper.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass

from .errors import CheckpointError, RequestError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # ▁


@dataclass(frozen=True)
class Encoding:
    ids: list[int]


class SpmTokenizer:
    """Scores-based SentencePiece BPE over a GGUF token list (see the module docstring)."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], *, add_space_prefix: bool,
                 bos_id: int | None, eos_id: int | None, unk_id: int | None, add_bos: bool, add_eos: bool,
                 source: str = "gguf"):
        if not (len(tokens) == len(scores) == len(types)):
            raise CheckpointError(f"{source}: tokenizer.ggml.tokens/scores/token_type have different lengths "
                                  f"({len(tokens)}, {len(scores)}, {len(types)})")
        # llama.cpp: an empty token text becomes "[EMPTY_i]", and a repeated text maps to its last id
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.scores = [float(s) for s in scores]
        self.types = [int(t) for t in types]
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.add_space_prefix = add_space_prefix
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.add_bos, self.add_eos = add_bos, add_eos
        special = [i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        # longest first (stable: lower id first among equal lengths)
        self.special = sorted(special, key=lambda i: -len(self.tokens[i]))
        self.byte_ids = [self._byte_token(b) for b in range(256)]

    def _byte_token(self, b: int) -> int | None:
        i = self.vocab.get(f"<0x{b:02X}>")
        if i is None and b < 128:
            i = self.vocab.get(chr(b))
        return i if i is not None else self.unk_id

    # --- the subset of tokenizers.Tokenizer the wrapper uses ---------------------------------
    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tokens[i] if 0 <= i < len(self.tokens) else None

    def token_to_id(self, text: str) -> int | None:
        return self.vocab.get(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        """Ids of ``text``, special-token text parsed. BOS is added by the wrapper; EOS here when the
        vocabulary asks for it (``tokenizer.ggml.add_eos_token``)."""
        out: list[int] = []
        prev_special = True  # a space prefix goes before the first fragment
        for frag in self._partition(text):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            self._encode_fragment(frag.replace(" ", SPACE), out)
            prev_special = False
        if add_special_tokens and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return Encoding(out)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special_tokens and self.add_bos and ids and ids[0] == self.bos_id:
            ids, remove_space = ids[1:], False  # as llama.cpp: the BOS took the prefix's place
        buf = bytearray()
        for i in ids:
            piece = self._piece(int(i), skip_special_tokens)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            buf += piece
        return buf.decode("utf-8", errors="replace")

    # --- internals ------------------------------------------------------------------------------
    def _piece(self, i: int, skip_special: bool) -> bytes:
        if not 0 <= i < len(self.tokens):
            raise RequestError(f"token id {i} is outside the vocabulary of {len(self.tokens)} tokens")
        kind, text = self.types[i], self.tokens[i]
        if kind == NORMAL:
            return text.replace(SPACE, " ").encode("utf-8")
        if kind == BYTE:
            return bytes([int(text[3:5], 16)])
        if kind == CONTROL:
            return b"" if skip_special else text.encode("utf-8")
        if kind in (USER_DEFINED, UNKNOWN):
            return text.encode("utf-8")
        return b""  # unused tokens render as nothing (llama.cpp)

    def _partition(self, text: str) -> list:
        """``text`` as a list of raw strings and special-token ids (llama.cpp's st_partition)."""
        frags: list = [text] if text else []
        for sid in self.special:
            tok = self.tokens[sid]
            if tok not in text:
                continue
            nxt: list = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    nxt.append(f)
                    continue
                pos = 0
                while True:
                    hit = f.find(tok, pos)
                    if hit < 0:
                        break
                    if hit > pos:
                        nxt.append(f[pos:hit])
                    nxt.append(sid)
                    pos = hit + len(tok)
                if pos < len(f):
                    nxt.append(f[pos:])
            frags = nxt
        return frags

    def _pair_priority(self, left: str, right: str) -> float | None:
        """When the adjacent symbols ``left`` ``right`` merge (lowest first), or None if they don't:
        here when their concatenation is a token, highest score first."""
        tid = self.vocab.get(left + right)
        return None if tid is None else -self.scores[tid]

    def _encode_fragment(self, text: str, out: list[int]) -> None:
        n = len(text)
        if n == 0:
            return
        # symbol i covers text[start[i] : start[i] + size[i]]; merged-away symbols have size 0
        start = list(range(n))
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n)) + [-1]
        vocab, priority = self.vocab, self._pair_priority
        heap: list[tuple[float, int, int, int]] = []

        def try_pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            mid = start[right]
            p = priority(text[start[left]: mid], text[mid: mid + size[right]])
            if p is not None:
                # equal priorities: leftmost first
                heapq.heappush(heap, (p, left, right, size[left] + size[right]))

        for i in range(1, n):
            try_pair(i - 1, i)
        while heap:
            _, left, right, length = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # stale: one side was merged into something else since
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_pair(prev[left], left)
            try_pair(left, nxt[left])
        i = 0
        while i != -1:
            piece = text[start[i]: start[i] + size[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:  # a piece outside the vocabulary (a character, for scores): its UTF-8 bytes
                for b in piece.encode("utf-8"):
                    bid = self.byte_ids[b]
                    if bid is None:
                        raise CheckpointError(f"character {piece!r} is not in the vocabulary and it has no "
                                              f"<0x{b:02X}> byte token nor an unknown token")
                    out.append(bid)
            i = nxt[i]


class SpmBpeTokenizer(SpmTokenizer):
    """llama.cpp's SentencePiece-style BPE (``tokenizer.ggml.model = "gemma4"``): pairs merge by
    their rank in ``merges`` (each ``"left right"``), newline runs apart (see the module docstring)."""

    _RUNS = re.compile(r"\n+|[^\n]+")

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], merges: list[tuple[str, str]],
                 **kw):
        super().__init__(tokens, scores, types, **kw)
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, pair in enumerate(merges):
            self.ranks.setdefault(pair, rank)  # a repeated pair keeps its first rank (llama.cpp)

    def _pair_priority(self, left: str, right: str) -> float | None:
        return self.ranks.get((left, right))

    def _encode_fragment(self, text: str, out: list[int]) -> None:
        for run in self._RUNS.findall(text):
            tid = self.vocab.get(run) if run[0] == "\n" else None
            if tid is not None:  # llama.cpp emits a newline run that is a token whole, merges or not
                out.append(tid)
            else:
                super()._encode_fragment(run, out)


def from_gguf_metadata(meta: dict, source: str) -> SpmTokenizer:
    """An :class:`SpmTokenizer` (``tokenizer.ggml.model = "llama"``) or :class:`SpmBpeTokenizer`
    (``"gemma4"``) from GGUF metadata, with llama.cpp's defaults for absent keys: for ``llama``
    BOS 1, EOS 2, UNK 0, add BOS, add a space prefix; for ``gemma4`` no default ids, no space
    prefix, and BOS always added (llama.cpp overrides ``add_bos_token = false``). Every field is
    type- and size-checked: a corrupt vocabulary is a :class:`CheckpointError` naming the file and
    the field."""
    from .tokenizer import _gguf_field, _gguf_strings

    bpe = meta.get("tokenizer.ggml.model") == "gemma4"
    tokens = _gguf_strings(meta, "tokenizer.ggml.tokens", source, required=True)
    if "tokenizer.ggml.scores" not in meta and not bpe:
        raise CheckpointError(f"{source}: GGUF metadata field 'tokenizer.ggml.scores' is missing "
                              "(a SentencePiece vocabulary needs its scores)")
    scores = _gguf_field(meta, "tokenizer.ggml.scores", list, source, [0.0] * len(tokens))
    types = _gguf_field(meta, "tokenizer.ggml.token_type", list, source, [NORMAL] * len(tokens))
    for key, arr, kind in (("tokenizer.ggml.scores", scores, (int, float)), ("tokenizer.ggml.token_type", types, int)):
        if len(arr) != len(tokens):
            raise CheckpointError(f"{source}: GGUF field '{key}' has {len(arr)} entries for {len(tokens)} tokens")
        if not all(isinstance(x, kind) for x in arr):
            raise CheckpointError(f"{source}: GGUF field '{key}' holds a value of the wrong type")

    def tid(key: str, default: int | None) -> int | None:
        if key not in meta:  # llama.cpp's default, where the vocabulary has it
            return default if default is not None and default < len(tokens) else None
        v = _gguf_field(meta, key, int, source, None)
        if v is not None and v >= len(tokens):
            raise CheckpointError(f"{source}: GGUF field '{key}' = {v} is outside the vocabulary of {len(tokens)} tokens")
        return None if v is None or v < 0 else v  # llama.cpp: a negative id means none

    def flag(key: str, default: bool) -> bool:
        return bool(_gguf_field(meta, key, (bool, int), source, default))

    add_eos = flag("tokenizer.ggml.add_eos_token", False)
    if not bpe:
        return SpmTokenizer(tokens, scores, types,
                            add_space_prefix=flag("tokenizer.ggml.add_space_prefix", True),
                            bos_id=tid("tokenizer.ggml.bos_token_id", 1), eos_id=tid("tokenizer.ggml.eos_token_id", 2),
                            unk_id=tid("tokenizer.ggml.unknown_token_id", 0),
                            add_bos=flag("tokenizer.ggml.add_bos_token", True), add_eos=add_eos, source=source)
    # llama.cpp's BPE path reads add_space_prefix but never adds one (flag() still type-checks it)
    flag("tokenizer.ggml.add_space_prefix", False)
    flag("tokenizer.ggml.add_bos_token", True)
    bos, eos = tid("tokenizer.ggml.bos_token_id", None), tid("tokenizer.ggml.eos_token_id", None)
    if bos is None:
        raise CheckpointError(f"{source}: GGUF field 'tokenizer.ggml.bos_token_id' is missing or negative "
                              "(a gemma4 vocabulary always adds BOS)")
    if add_eos and eos is None:
        raise CheckpointError(f"{source}: GGUF field 'tokenizer.ggml.eos_token_id' is missing or negative "
                              "(tokenizer.ggml.add_eos_token is true)")
    if "tokenizer.ggml.merges" not in meta:
        raise CheckpointError(f"{source}: GGUF field 'tokenizer.ggml.merges' is missing (a gemma4 vocabulary needs its merges)")
    merges = []
    for m in _gguf_strings(meta, "tokenizer.ggml.merges", source):
        cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            raise CheckpointError(f"{source}: GGUF field 'tokenizer.ggml.merges' has an entry without a space: {m!r}")
        merges.append((m[:cut], m[cut + 1:]))
    return SpmBpeTokenizer(tokens, scores, types, merges, add_space_prefix=False, bos_id=bos, eos_id=eos,
                           unk_id=tid("tokenizer.ggml.unknown_token_id", None), add_bos=True, add_eos=add_eos,
                           source=source)
