"""The tokenizer as GGUF metadata, from an HF directory's ``tokenizer.json`` and
``tokenizer_config.json`` (plus ``chat_template.jinja`` when present).

Two kinds are supported. Byte-level BPE (llama.cpp's ``gpt2`` model: Llama 3, SmolLM2, Qwen):
tokens and merges as they are. SentencePiece BPE with byte fallback (llama.cpp's ``llama``
model: Gemma), which llama.cpp's converter reads from ``tokenizer.model``: here the scores are
rebuilt from ``tokenizer.json``'s merge ranks, after checking the merges are SentencePiece's
(see :func:`_spm_scores`), so the file encodes as the HF tokenizer does.

For byte-level BPE, llama.cpp names the pre-tokenizer by hashing the token ids of a probe text;
here it is read from ``tokenizer.json``'s pre-tokenizer itself (its split regex or its digit
rule), so the name is one that llama.cpp (and specdec) map back to the same regexes.
"""

from __future__ import annotations

import json
import os

import gguf

from ..errors import CheckpointError
from .plan import Plan

K = gguf.Keys.Tokenizer
SPACE = "\u2581"  # ▁, SentencePiece's space
# distinctive pieces of the split regex of each pre-tokenizer llama.cpp knows (checked in order)
_REGEX_NAMES = (
    (r"[\p{L}\p{M}]+", "qwen35"),
    (r"\p{N}{1,3}", "llama-bpe"),
    (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|", "qwen2"),
    (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+", "gpt-2"),
)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e


def _pre_parts(pre: dict | None) -> list[dict]:
    if not pre:
        return []
    if pre.get("type") == "Sequence":
        return [p for sub in pre.get("pretokenizers", []) for p in _pre_parts(sub)]
    return [pre]


def pre_tokenizer_name(tj: dict, path: str) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name for ``tokenizer.json``'s pre-tokenizer."""
    parts = _pre_parts(tj.get("pre_tokenizer"))
    for p in parts:
        if p.get("type") == "Split":
            regex = (p.get("pattern") or {}).get("Regex", "")
            for piece, name in _REGEX_NAMES:
                if piece in regex:
                    return name
            raise CheckpointError(f"{path}: pre-tokenizer split regex {regex!r} matches no pre-tokenizer llama.cpp knows")
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"  # SmolLM / StarCoder: single digits, then GPT-2's byte-level regex
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    raise CheckpointError(f"{path}: pre-tokenizer {kinds or 'none'} is not one llama.cpp knows (byte-level BPE needed)")


def _token_id(vocab: dict[str, int], v) -> int | None:
    if isinstance(v, dict):
        v = v.get("content")
    return vocab.get(v) if isinstance(v, str) else None


def _adds_bos(tj: dict, bos: str | None) -> bool:
    """Whether the post-processor prepends BOS to a single sequence (Llama 3's TemplateProcessing)."""
    procs = [tj.get("post_processor") or {}]
    if procs[0].get("type") == "Sequence":
        procs = procs[0].get("processors", [])
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            first = (p.get("single") or [{}])[0]
            return "SpecialToken" in first and first["SpecialToken"].get("id") == bos
    return False


def add_vocab(plan: Plan, hf_dir: str, vocab_size: int, config_eos: list[int]) -> None:
    """Add the ``tokenizer.*`` metadata of ``hf_dir`` to ``plan``, padded to ``vocab_size``
    tokens (the embedding's rows) with unused ``[PADi]`` tokens as llama.cpp does."""
    tj_path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(tj_path):
        raise CheckpointError(f"{tj_path}: not found (convert reads fast-tokenizer files; "
                              f"pass --no-vocab to write the weights without a tokenizer)")
    tj = _read_json(tj_path)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(f"{tj_path}: tokenizer model '{model.get('type')}' is not supported "
                              "(byte-level BPE, or SentencePiece BPE with byte fallback)")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    n = max(vocab.values()) + 1
    if n > vocab_size:
        raise CheckpointError(f"{tj_path}: {n} tokens, more than the model's vocab_size={vocab_size}")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    cfg_path = os.path.join(hf_dir, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    if model.get("byte_fallback"):
        _spm_vocab(plan, tj, tj_path, vocab, added, merges, vocab_size, model.get("unk_token"))
        add_eos = cfg.get("add_eos_token")
        plan.boolean(K.ADD_EOS, bool(add_eos))
    else:
        _gpt2_vocab(plan, tj, tj_path, vocab, added, merges, vocab_size)
    _special_ids(plan, tj, cfg, vocab, config_eos)
    template = cfg.get("chat_template")
    jinja = os.path.join(hf_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            template = fh.read()
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template:
        plan.string(K.CHAT_TEMPLATE, template)


def _gpt2_vocab(plan: Plan, tj: dict, tj_path: str, vocab: dict[str, int], added: dict, merges: list,
                vocab_size: int) -> None:
    """Byte-level BPE: llama.cpp's ``gpt2`` model (tokens, types, merges, pre-tokenizer name)."""
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for tok, i in vocab.items():
        tokens[i] = tok
        a = added.get(tok)
        types[i] = int(gguf.TokenType.NORMAL if a is None else
                       gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    plan.string(K.MODEL, "gpt2")
    plan.string(K.PRE, pre_tokenizer_name(tj, tj_path))
    plan.array(K.LIST, tokens)
    plan.array(K.TOKEN_TYPE, types)
    if merges:
        plan.array(K.MERGES, [" ".join(m) for m in merges])


def _spm_space_prefix(tj: dict, tj_path: str) -> bool:
    """``add_space_prefix`` of a SentencePiece-derived ``tokenizer.json``: spaces must become
    ``"▁"`` in the normalizer (Gemma: ``Replace``; a ``Prepend("▁")`` adds the dummy prefix) or
    a ``Metaspace`` pre-tokenizer; anything else is a tokenizer llama.cpp's SPM model cannot mirror."""
    norms = [tj.get("normalizer") or {}]
    if norms[0].get("type") == "Sequence":
        norms = norms[0].get("normalizers", [])
    kinds = [nm.get("type") for nm in norms if nm]
    pre = _pre_parts(tj.get("pre_tokenizer"))
    replaces = any(nm.get("type") == "Replace" and (nm.get("pattern") or {}).get("String") == " "
                   and nm.get("content") == SPACE for nm in norms)
    prepend = any(nm.get("type") == "Prepend" and nm.get("prepend") == SPACE for nm in norms)
    if replaces and set(kinds) <= {"Replace", "Prepend"}:
        # after the normalizer no space is left: only a split on " " (Gemma's) is a no-op
        if all(p.get("type") == "Split" and (p.get("pattern") or {}).get("String") == " " for p in pre):
            return prepend
    elif not kinds and [p.get("type") for p in pre] == ["Metaspace"] and pre[0].get("replacement", SPACE) == SPACE \
            and not pre[0].get("split", False):
        return pre[0].get("prepend_scheme", "always") in ("always", "first")
    raise CheckpointError(f"{tj_path}: a byte-fallback BPE tokenizer with normalizer {kinds or 'none'} and "
                          f"pre-tokenizer {[p.get('type') for p in pre] or 'none'} is not supported "
                          "(SentencePiece style needed: spaces as '\u2581', no other pre-tokenization)")


def _spm_scores(tj_path: str, vocab: dict[str, int], merges: list, normal: set[str]) -> dict[str, float]:
    """SentencePiece scores from the merge list: llama.cpp's SPM model merges the adjacent pair
    whose result scores highest, HF's BPE the pair ranked first, so a token scores
    ``-rank`` of the merges that make it. That is the same encoder only when the merges are
    SentencePiece's (as transformers' converter writes them): every split of a token into two
    tokens is a merge, and the merges making one token are consecutive. Checked, not assumed."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    pairs = set()
    for r, (a, b) in enumerate(merges):
        t = a + b
        if t in last and last[t] != r - 1:
            raise CheckpointError(f"{tj_path}: the merges making {t!r} are not consecutive; these are not "
                                  "SentencePiece merges, so no SPM vocabulary encodes the same")
        first.setdefault(t, r)
        last[t] = r
        pairs.add((a, b))
    for t in normal:
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab and (t[:k], t[k:]) not in pairs:
                raise CheckpointError(f"{tj_path}: token {t!r} splits into {t[:k]!r} + {t[k:]!r} but that is no "
                                      "merge; these are not SentencePiece merges, so no SPM vocabulary encodes "
                                      "the same")
    n = len(merges)
    return {t: float(-first[t]) if t in first else float(-(n + vocab[t])) for t in normal}


def _spm_vocab(plan: Plan, tj: dict, tj_path: str, vocab: dict[str, int], added: dict, merges: list,
               vocab_size: int, unk: str | None) -> None:
    """SentencePiece BPE with byte fallback (Gemma): llama.cpp's ``llama`` model (tokens, scores, types)."""
    T = gguf.TokenType
    prefix = _spm_space_prefix(tj, tj_path)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(T.UNUSED)] * vocab_size
    scores = [-1000.0] * vocab_size
    normal = set()
    for tok, i in vocab.items():
        tokens[i] = tok
        a = added.get(tok)
        if tok == unk:
            types[i] = int(T.UNKNOWN)
        elif a is not None:
            types[i] = int(T.CONTROL if a.get("special") else T.USER_DEFINED)
            if not a.get("special") and a.get("normalized"):  # HF matches it in the normalized text,
                tokens[i] = tok.replace(SPACE, " ")  # llama.cpp in the raw text (as its converter writes it)
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            types[i], scores[i] = int(T.BYTE), 0.0
        else:
            types[i] = int(T.NORMAL)
            normal.add(tok)
    for tok, s in _spm_scores(tj_path, vocab, merges, normal).items():
        scores[vocab[tok]] = s
    plan.string(K.MODEL, "llama")
    plan.string(K.PRE, "default")
    plan.array(K.LIST, tokens)
    plan.array(K.SCORES, scores)
    plan.array(K.TOKEN_TYPE, types)
    plan.boolean(K.ADD_PREFIX, prefix)
    if unk in vocab:
        plan.u32(K.UNK_ID, vocab[unk])


def _special_ids(plan: Plan, tj: dict, cfg: dict, vocab: dict[str, int], config_eos: list[int]) -> None:
    bos = _token_id(vocab, cfg.get("bos_token"))
    eos = _token_id(vocab, cfg.get("eos_token"))
    if eos is None and config_eos:
        eos = config_eos[0]
    pad = _token_id(vocab, cfg.get("pad_token"))
    for key, v in ((K.BOS_ID, bos), (K.EOS_ID, eos), (K.PAD_ID, pad)):
        if v is not None:
            plan.u32(key, v)
    bos_text = cfg.get("bos_token")
    bos_text = bos_text.get("content") if isinstance(bos_text, dict) else bos_text
    add_bos = cfg.get("add_bos_token")
    plan.boolean(K.ADD_BOS, bool(add_bos) if add_bos is not None else _adds_bos(tj, bos_text))
