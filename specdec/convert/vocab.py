"""The tokenizer as GGUF metadata, from an HF directory's ``tokenizer.json`` and
``tokenizer_config.json`` (plus ``chat_template.jinja`` when present).

Only byte-level BPE tokenizers (llama.cpp's ``gpt2`` model: Llama 3, SmolLM2, Qwen) are
supported. llama.cpp names the pre-tokenizer by hashing the token ids of a probe text; here it
is read from ``tokenizer.json``'s pre-tokenizer itself (its split regex or its digit rule), so
the name is one that llama.cpp (and specdec) map back to the same regexes.
"""

from __future__ import annotations

import json
import os

import gguf

from ..errors import CheckpointError
from .plan import Plan

K = gguf.Keys.Tokenizer
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
        raise CheckpointError(f"{tj_path}: tokenizer model '{model.get('type')}' is not supported (byte-level BPE only)")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    n = max(vocab.values()) + 1
    if n > vocab_size:
        raise CheckpointError(f"{tj_path}: {n} tokens, more than the model's vocab_size={vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for tok, i in vocab.items():
        tokens[i] = tok
        a = added.get(tok)
        types[i] = int(gguf.TokenType.NORMAL if a is None else
                       gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    cfg_path = os.path.join(hf_dir, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    plan.string(K.MODEL, "gpt2")
    plan.string(K.PRE, pre_tokenizer_name(tj, tj_path))
    plan.array(K.LIST, tokens)
    plan.array(K.TOKEN_TYPE, types)
    if merges:
        plan.array(K.MERGES, merges)
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
    template = cfg.get("chat_template")
    jinja = os.path.join(hf_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            template = fh.read()
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template:
        plan.string(K.CHAT_TEMPLATE, template)
