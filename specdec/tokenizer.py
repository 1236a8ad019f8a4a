"""Tokenizers from HF directories (``tokenizer.json``) and from GGUF metadata, plus chat templates.

GGUF BPE vocabularies are rebuilt as a ``tokenizers`` BPE model with llama.cpp's pre-tokenizer
regexes for the file's ``tokenizer.ggml.pre`` type, so ids match llama.cpp's. SentencePiece
vocabularies (``tokenizer.ggml.model = "llama"``) use :class:`specdec.spm.SpmTokenizer`, which
follows llama.cpp's SPM tokenizer, and Gemma 4's SentencePiece-style BPE (``"gemma4"``) its
subclass :class:`specdec.spm.SpmBpeTokenizer`, which follows llama.cpp's BPE tokenizer for it.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from .config import read_json
from .errors import CheckpointError, RequestError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT = r"\p{N}"
# llama.cpp's default BPE pre-tokenizer (a file that names no known pre-tokenizer)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
# llama.cpp's regex sequences per tokenizer.ggml.pre (applied one after the other), grouped the
# way llama-vocab.cpp groups the names; "gpt2" is kept for files written by older tools.
PRE_REGEXES = {"default": _DEFAULT}
PRE_REGEXES.update(dict.fromkeys(
    ("gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "gigachat", "a.x-4.0",
     "mellum", "mpt", "olmo", "jais", "trillion", "granite-docling"), [_GPT2]))
PRE_REGEXES.update(dict.fromkeys(
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), [_DIGIT, _GPT2]))
PRE_REGEXES.update(dict.fromkeys(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"),
    [_LLAMA3]))
PRE_REGEXES.update(dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), [_QWEN2]))
PRE_REGEXES["qwen35"] = [_QWEN35]
# Pre-tokenizers for which llama.cpp emits a whole pre-token as one id when the vocabulary has
# it, before trying merges (HF's BPE ``ignore_merges``); the merges can reach a different split.
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
# Pre-tokenizers for which llama.cpp adds BOS when the file has no tokenizer.ggml.add_bos_token.
ADD_BOS_DEFAULT = IGNORE_MERGES
# end-of-turn token texts llama.cpp recognises when a SentencePiece file names no EOT id
SPM_EOT_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<EOT>")
# Gemma 4's end-of-generation tokens besides EOS, by text as llama.cpp finds them: the end of a
# turn, and the start of a tool's answer (the model stops there for the caller to run the tool)
GEMMA4_EOG_TEXTS = ("<turn|>", "<|tool_response>")
# token types in tokenizer.ggml.token_type
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """Text <-> ids, special tokens and the chat template of one model."""

    def __init__(self, tok: HFTokenizer, *, bos_id: int | None, eos_ids: list[int], add_bos: bool,
                 chat_template: str | None, source: str):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = list(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source
        self._template = None  # (template text, compiled template): see _compiled_template

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special``: add what the model adds to a plain prompt (BOS).

        Special-token text (``<|im_start|>`` ...) is always parsed as the special token, so a
        rendered chat template encodes as the model expects.
        """
        # tokenizer.json's post-processor adds BOS where a model wants it (Llama 3), as in transformers
        ids = self.tok.encode(text, add_special_tokens=add_special).ids
        if add_special and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's Jinja chat template (as transformers does)."""
        from jinja2.exceptions import TemplateError

        template = self._compiled_template()
        bos = self.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.id_to_token(self.eos_ids[0]) if self.eos_ids else ""
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                                   eos_token=eos)
        except TemplateError as e:  # raise_exception() in the template, or a name it lacks
            raise RequestError(f"{self.source}: the chat template refused these messages ({e})") from e

    def _compiled_template(self):
        """The chat template compiled once (compiling is ~95 % of a render: ~6 ms a prompt, which
        was ~48 s of a training run's start on 14k prompts), again only if it was replaced."""
        if not self.chat_template:
            raise CheckpointError(f"{self.source}: the model has no chat template; pass a plain prompt instead of --chat")
        if self._template is not None and self._template[0] == self.chat_template:
            return self._template[1]
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(self.chat_template)
        except TemplateSyntaxError as e:
            raise CheckpointError(f"{self.source}: the chat template does not parse (line {e.lineno}: {e.message})") from e
        self._template = (self.chat_template, template)
        return template

    # --- constructors -------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str, eos_ids: list[int] | None = None) -> "Tokenizer":
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise CheckpointError(f"{path}: no tokenizer.json (specdec reads fast-tokenizer files only)")
        try:
            tok = HFTokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(f"{tj}: cannot parse tokenizer ({e})") from e
        cfg = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(tc):
            cfg = read_json(tc)
        template = _chat_template(cfg.get("chat_template"), tc)
        jt = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jt):
            try:
                with open(jt, encoding="utf-8") as fh:
                    template = fh.read()
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{jt}: cannot read the chat template ({e})") from e

        def tok_id(v):
            if isinstance(v, dict):
                v = v.get("content")
            return tok.token_to_id(v) if isinstance(v, str) else None

        bos = tok_id(cfg.get("bos_token"))
        eos = list(eos_ids or [])
        e = tok_id(cfg.get("eos_token"))
        if e is not None and e not in eos:
            eos.append(e)
        # tokenizer.json's post-processor adds BOS itself when the model wants it (see encode);
        # add_bos_token covers configs that ask for BOS without one
        return cls(tok, bos_id=bos, eos_ids=eos, add_bos=bool(cfg.get("add_bos_token", False)),
                   chat_template=template, source=path)

    @classmethod
    def from_gguf(cls, meta: dict, source: str) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind in ("llama", "gemma4"):
            return cls._from_gguf_spm(meta, source)
        if kind != "gpt2":
            raise CheckpointError(f"{source}: GGUF tokenizer model '{kind}' is not supported "
                                  "(supported: gpt2 BPE, llama SentencePiece, gemma4 SentencePiece-style BPE)")
        tokens = _gguf_strings(meta, "tokenizer.ggml.tokens", source, required=True)
        types = _gguf_field(meta, "tokenizer.ggml.token_type", list, source, [1] * len(tokens))
        if len(types) != len(tokens):
            raise CheckpointError(f"{source}: GGUF field 'tokenizer.ggml.token_type' has {len(types)} entries for "
                                  f"{len(tokens)} tokens")
        merges = [tuple(m.split(" ", 1)) for m in _gguf_strings(meta, "tokenizer.ggml.merges", source)]
        if any(len(m) != 2 for m in merges):
            bad = next(" ".join(m) for m in merges if len(m) != 2)
            raise CheckpointError(f"{source}: GGUF field 'tokenizer.ggml.merges' has an entry without a space: {bad!r}")
        vocab = {t: i for i, t in enumerate(tokens)}
        pre = _gguf_field(meta, "tokenizer.ggml.pre", str, source, "default")
        if pre not in PRE_REGEXES:
            raise CheckpointError(f"{source}: GGUF pre-tokenizer '{pre}' is not supported (supported: {', '.join(sorted(PRE_REGEXES))})")
        try:
            tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
        except Exception as e:  # tokenizers raises plain Exception for a merge of unknown tokens
            raise CheckpointError(f"{source}: GGUF field 'tokenizer.ggml.merges' does not fit "
                                  f"'tokenizer.ggml.tokens' ({e})") from e
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_REGEXES[pre]]
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
        tok.add_special_tokens(special)
        eos = _gguf_token_id(meta, "tokenizer.ggml.eos_token_id", len(tokens), source)
        eos_ids = [eos] if eos is not None else []
        eot = _gguf_token_id(meta, "tokenizer.ggml.eot_token_id", len(tokens), source)
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        bos = _gguf_token_id(meta, "tokenizer.ggml.bos_token_id", len(tokens), source)
        add_bos = _gguf_field(meta, "tokenizer.ggml.add_bos_token", (bool, int), source, pre in ADD_BOS_DEFAULT)
        return cls(tok, bos_id=bos, eos_ids=eos_ids, add_bos=bool(add_bos),
                   chat_template=_gguf_field(meta, "tokenizer.chat_template", str, source, None), source=source)


    @classmethod
    def _from_gguf_spm(cls, meta: dict, source: str) -> "Tokenizer":
        from .spm import from_gguf_metadata

        spm = from_gguf_metadata(meta, source)
        eos_ids = [spm.eos_id] if spm.eos_id is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is None:  # llama.cpp finds the end-of-turn token by its text when the file names none
            eot = next((spm.vocab[t] for t in SPM_EOT_TEXTS if t in spm.vocab), None)
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        if meta.get("tokenizer.ggml.model") == "gemma4":
            eos_ids += [spm.vocab[t] for t in GEMMA4_EOG_TEXTS if t in spm.vocab and spm.vocab[t] not in eos_ids]
        return cls(spm, bos_id=spm.bos_id, eos_ids=eos_ids, add_bos=spm.add_bos,
                   chat_template=meta.get("tokenizer.chat_template"), source=source)


def _chat_template(template, source: str) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates (take
    the one named ``default``, else the first)."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and template and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
        return next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    raise CheckpointError(f"{source}: field 'chat_template' must be a string or a list of "
                          f"{{\"name\": ..., \"template\": ...}} objects")


def _gguf_field(meta: dict, key: str, kind, source: str, default):
    """``meta[key]`` if present (it must be a ``kind``), else ``default``."""
    v = meta.get(key)
    if v is None:
        return default
    if not isinstance(v, kind):
        raise CheckpointError(f"{source}: GGUF field '{key}' has the wrong type ({type(v).__name__})")
    return v


def _gguf_strings(meta: dict, key: str, source: str, required: bool = False) -> list[str]:
    """A GGUF array of strings; a missing, non-array or non-string entry names the field."""
    if required and key not in meta:
        raise CheckpointError(f"{source}: GGUF field '{key}' is missing")
    v = _gguf_field(meta, key, list, source, [])
    bad = next((i for i, x in enumerate(v) if not isinstance(x, str)), None)
    if bad is not None:
        raise CheckpointError(f"{source}: GGUF field '{key}' entry #{bad} is a {type(v[bad]).__name__}, not a string")
    return v


def _gguf_token_id(meta: dict, key: str, n_tokens: int, source: str) -> int | None:
    """A token id field, checked against the vocabulary size."""
    v = _gguf_field(meta, key, int, source, None)
    if v is not None and not 0 <= v < n_tokens:
        raise CheckpointError(f"{source}: GGUF field '{key}' = {v} is outside the vocabulary of {n_tokens} tokens")
    return v
