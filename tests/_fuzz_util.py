"""Fuzzing the checkpoint loaders: corrupted copies of small real checkpoints, each loaded the way
the CLI loads it; every outcome must be a clean load or a :class:`SpecdecError`, quickly and
without a runaway allocation.

Four seeds, written once per run (``build_seeds``):

- ``gguf``: a tiny Llama GGUF whose vocabulary is the first ``VOCAB`` tokens of the real SmolLM2
  GGUF (specials, bytes and the merges among them), so byte flips land in real token and merge
  strings, as in the corpus of issue 15;
- ``hf``: the same model as a sharded safetensors checkpoint (index, ``config.json``,
  ``tokenizer.json`` with the same vocabulary and merges);
- ``dflash``: a DFlash drafter directory for the tiny Llama (loaded against it);
- ``mtp``: a tiny Qwen3.5 checkpoint with ``mtp.*`` (loaded, then its MTP drafter built);
- ``mtp-gguf``: the same in llama.cpp's GGUF layout (``blk.4.nextn.*``).

Each corrupted copy is described with ``specdec info`` and then loaded (:func:`_steps`).

Mutations (``mutate``): 1-8 byte flips in a binary file's header region (metadata and tensor
table of a GGUF, JSON header of a safetensors file), a u64 field overwritten with a huge or zero
value, a random truncation, and for JSON files random byte flips or a structured edit (a value
replaced by a huge, negative, zero, empty, wrongly typed one, or a key dropped).
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import struct
import time
import warnings
from dataclasses import dataclass

import numpy as np

import gguf

VOCAB = 320
HIDDEN, INTER, HEADS, KV, LAYERS = 64, 128, 4, 2, 2
KINDS = ("gguf", "hf", "dflash", "mtp", "mtp-gguf", "gemma-gguf")
# the tiny Llama with the whole SmolLM2 vocabulary (49152 tokens, 48900 merges): the issue's
# corpus, ~0.3 s a case, so only for scripts/fuzz_loaders.py --kinds gguf-full
EXTRA_KINDS = ("gguf-full",)
_U64S = (0, 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)


# --- seeds ------------------------------------------------------------------------------------

def smollm2_vocab(n: int | None = VOCAB) -> tuple[list[str], list[int], list[str]]:
    """The first ``n`` tokens (None: all) of the real SmolLM2 vocabulary, their types, and the
    merges whose parts and result are all among them (in the file's order)."""
    from specdec.api import default_model_path
    from specdec.weights.gguf_io import GGUFSource

    meta = GGUFSource(default_model_path()).metadata
    tokens = meta["tokenizer.ggml.tokens"][:n]
    types = meta["tokenizer.ggml.token_type"][:n]
    known = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if m.replace(" ", "", 1) in known and all(p in known for p in m.split(" ", 1))]
    return tokens, types, merges


def _dense_tensors(vocab: int = VOCAB, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of a tied-embedding Llama, llama.cpp names, numpy shapes [rows, cols]."""
    rng = np.random.default_rng(seed)
    rnd = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    hd = HIDDEN // HEADS
    t = {"token_embd.weight": rnd(vocab, HIDDEN), "output_norm.weight": 1 + rnd(HIDDEN)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": 1 + rnd(HIDDEN), p + "ffn_norm.weight": 1 + rnd(HIDDEN),
                  p + "attn_q.weight": rnd(HIDDEN, HIDDEN), p + "attn_k.weight": rnd(KV * hd, HIDDEN),
                  p + "attn_v.weight": rnd(KV * hd, HIDDEN), p + "attn_output.weight": rnd(HIDDEN, HIDDEN),
                  p + "ffn_gate.weight": rnd(INTER, HIDDEN), p + "ffn_up.weight": rnd(INTER, HIDDEN),
                  p + "ffn_down.weight": rnd(HIDDEN, INTER)})
    return t


def write_gguf_seed(path: str, vocab) -> None:
    """A tiny Llama GGUF (llama.cpp's keys) with the SmolLM2 vocabulary slice ``vocab``."""
    tokens, types, merges = vocab
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, a in _dense_tensors(len(tokens)).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_name(gname: str) -> str:
    from specdec.models.gguf_names import DENSE_BLOCK

    if gname == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gname == "output_norm.weight":
        return "model.norm.weight"
    _, i, suffix = gname.split(".", 2)
    return f"model.layers.{i}.{DENSE_BLOCK[suffix]}"


def write_hf_seed(path: str, vocab) -> None:
    """The tiny Llama as an HF directory: two safetensors shards with an index, config.json,
    tokenizer.json (same vocabulary) and tokenizer_config.json."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    tokens, _, merges = vocab
    os.makedirs(path, exist_ok=True)
    tensors = {_hf_name(k): v for k, v in _dense_tensors().items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, os.path.join(path, fname))
        weight_map.update(dict.fromkeys(part, fname))
    _dump(os.path.join(path, "model.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map})
    _dump(os.path.join(path, "config.json"), {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2})
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.save(os.path.join(path, "tokenizer.json"))
    _dump(os.path.join(path, "tokenizer_config.json"), {"bos_token": tokens[1], "eos_token": tokens[2],
                                                        "chat_template": "{{ messages[0]['content'] }}"})


def write_dflash_seed(path: str) -> None:
    from _dflash_util import write_drafter

    write_drafter(path, hidden=HIDDEN, num_target_layers=LAYERS, n_layers=1, target_layer_ids=(0, 1), block_size=4)


def write_mtp_seed(path: str) -> None:
    from _mtp_util import build_qwen35

    build_qwen35(path, moe=False, mtp=True)


def write_mtp_gguf_seed(path: str) -> None:
    """The Qwen3.5 checkpoint with ``mtp.*`` as llama.cpp writes it (``blk.4.nextn.*``, per-layer
    ``recurrent_layers`` flags); it has no vocabulary, so it is loaded without a tokenizer."""
    from _qwen35_util import write_gguf

    hf = os.path.join(path, "hf")
    write_mtp_seed(hf)
    write_gguf(hf, os.path.join(path, "model.gguf"), recurrent_layers=True)
    shutil.rmtree(hf)


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh)


@dataclass
class Seed:
    """One checkpoint to corrupt: its files (relative path -> bytes) and the entry loaded."""

    kind: str
    files: dict[str, bytes]
    entry: str  # relative path given to the loader ("" = the directory)

    def header_end(self, rel: str) -> int:
        """Bytes at the start of file ``rel`` that hold metadata (mutations aim there)."""
        data = self.files[rel]
        if rel.endswith(".gguf"):
            return _gguf_data_start(data)
        if rel.endswith(".safetensors"):
            return 8 + struct.unpack_from("<Q", data)[0]
        return len(data)


def _gguf_data_start(data: bytes) -> int:
    import tempfile

    from specdec.weights.gguf_io import GGUFSource

    with tempfile.NamedTemporaryFile(suffix=".gguf") as fh:
        fh.write(data)
        fh.flush()
        src = GGUFSource(fh.name)
        return min(start for _, start, _ in src._tensors.values())


def write_gemma_gguf_seed(path: str) -> None:
    """A tiny Gemma 3 GGUF in llama.cpp's layout with a SentencePiece vocabulary (scores, byte
    fallback, control tokens): the SPM tokenizer path."""
    from _gemma_util import tiny_model, write_gguf

    write_gguf(tiny_model("llama_cpp"), os.path.join(path, "model.gguf"))


def build_seeds(root: str, kinds=KINDS) -> dict[str, Seed]:
    """Write every seed under ``root`` and read it back as a :class:`Seed`."""
    vocab = smollm2_vocab()
    writers = {"gguf": lambda p: write_gguf_seed(os.path.join(p, "model.gguf"), vocab),
               "gguf-full": lambda p: write_gguf_seed(os.path.join(p, "model.gguf"), smollm2_vocab(None)),
               "hf": lambda p: write_hf_seed(p, vocab), "dflash": write_dflash_seed, "mtp": write_mtp_seed,
               "mtp-gguf": write_mtp_gguf_seed, "gemma-gguf": write_gemma_gguf_seed}
    seeds = {}
    for kind in kinds:
        d = os.path.join(root, "seed-" + kind)
        os.makedirs(d, exist_ok=True)
        writers[kind](d)
        files = {}
        for f in sorted(os.listdir(d)):
            with open(os.path.join(d, f), "rb") as fh:
                files[f] = fh.read()
        seeds[kind] = Seed(kind, files, "model.gguf" if "model.gguf" in files else "")
    return seeds


# --- mutations --------------------------------------------------------------------------------

def mutate(seed: Seed, rng: random.Random) -> tuple[dict[str, bytes], str]:
    """A corrupted copy of ``seed``'s files and a one-line description of the corruption."""
    files = dict(seed.files)
    rel = rng.choice(sorted(files))
    data = bytearray(files[rel])
    end = max(seed.header_end(rel), 1)
    binary = not rel.endswith(".json")
    op = rng.choice(("flip", "u64", "truncate") if binary else ("flip", "edit", "edit", "truncate"))
    if op == "flip":
        n = rng.randint(1, 8)
        for _ in range(n):
            i = rng.randrange(end) if binary and rng.random() < 0.9 else rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        what = f"{n} bit flip(s)"
    elif op == "u64":
        i = rng.randrange(max(end - 8, 1))
        v = rng.choice(_U64S + (rng.getrandbits(64),))
        data[i:i + 8] = struct.pack("<Q", v)
        what = f"u64 {v} at byte {i}"
    elif op == "truncate":
        n = rng.randrange(len(data))
        del data[n:]
        what = f"truncated to {n} bytes"
    else:
        data, what = _edit_json(bytes(data), rng)
    files[rel] = bytes(data)
    return files, f"{rel}: {what}"


_ODD = (None, True, -1, 0, 2**63, 2**64 + 1, 1e308, "", "x", [], [1, "a"], {}, {"a": 1}, 3.5)


def _edit_json(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Replace one value somewhere in a JSON document by an odd one, or drop one key."""
    doc = json.loads(raw)
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        parent, node = node, node[key]
        path.append(key)
    if not path:
        return json.dumps(rng.choice(_ODD)).encode(), "document replaced"
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[path[-1]]
        return json.dumps(doc).encode(), f"dropped {path}"
    v = rng.choice(_ODD)
    parent[path[-1]] = v
    return json.dumps(doc).encode(), f"{path} = {v!r}"


# --- running ----------------------------------------------------------------------------------

class CaseTimeout(BaseException):
    """A case ran past its time limit (a BaseException so that no loader can swallow it)."""


@dataclass
class Outcome:
    kind: str  # "loaded" | "error" | "raw" | "timeout"
    seconds: float
    rss_growth_mb: float  # growth of the process's peak RSS (a high-water mark) during the case
    detail: str


def _steps(kind: str, path: str, target) -> list[tuple[str, object]]:
    """What is done with one corrupted checkpoint: ``specdec info`` on it, then the load the CLI
    does (target, tokenizer and a chat prompt; DFlash drafter for the tiny target; target and
    MTP drafter)."""
    from specdec.drafters.dflash import load_dflash_drafter
    from specdec.drafters.mtp import load_mtp_drafter
    from specdec.info import describe
    from specdec.loading import load_model

    def load_and_chat():
        tok = load_model(path, device="cpu").tokenizer
        if tok is not None and tok.chat_template:
            tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special=False)
        if tok is not None:
            tok.decode(tok.encode("Hello, world! 123 é"))

    load = {"gguf": load_and_chat, "gguf-full": load_and_chat, "hf": load_and_chat, "gemma-gguf": load_and_chat,
            "dflash": lambda: load_dflash_drafter(path, target),
            "mtp": lambda: load_mtp_drafter(load_model(path, device="cpu")),
            "mtp-gguf": lambda: load_mtp_drafter(load_model(path, device="cpu", tokenizer=False))}[kind]
    return [("info", lambda: describe(path)), ("load", load)]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _on_alarm(signum, frame):
    raise CaseTimeout()


def run_case(seed: Seed, files: dict[str, bytes], workdir: str, target, time_limit: float = 5.0) -> Outcome:
    """Write ``files`` to a fresh ``workdir``, run :func:`_steps` on them, and classify what
    happened (a raw exception or a timeout in any step wins)."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    for rel, data in files.items():
        with open(os.path.join(workdir, rel), "wb") as fh:
            fh.write(data)
    path = os.path.join(workdir, seed.entry) if seed.entry else workdir
    rss0, t0 = _peak_rss_mb(), time.perf_counter()
    results = [_run_step(name, fn, time_limit) for name, fn in _steps(seed.kind, path, target)]
    worst = next((r for r in results if r[0] in ("raw", "timeout")), results[-1])
    return Outcome(worst[0], time.perf_counter() - t0, _peak_rss_mb() - rss0, worst[1])


def _run_step(name: str, fn, time_limit: float) -> tuple[str, str]:
    """(outcome kind, detail) of one step, under a SIGALRM time limit."""
    from specdec.errors import SpecdecError

    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on zero-size meta tensors and the like
            fn()
        return "loaded", ""
    except SpecdecError as e:
        return "error", f"{name}: {e}"
    except CaseTimeout:
        return "timeout", f"{name}: no outcome within {time_limit} s"
    except Exception as e:  # the point of the fuzz: anything else is a finding  # noqa: BLE001
        return "raw", f"{name}: {type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def load_target(seeds: dict[str, Seed], workdir: str):
    """The tiny Llama the DFlash drafters are loaded against (from the uncorrupted GGUF seed)."""
    from specdec.loading import load_model

    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "target.gguf")
    with open(path, "wb") as fh:
        fh.write(seeds["gguf"].files["model.gguf"])
    return load_model(path, device="cpu", tokenizer=False)


def fuzz(seeds: dict[str, Seed], root: str, cases: int, seed: int = 0, time_limit: float = 5.0, kinds=None):
    """Run ``cases`` corrupted checkpoints, round robin over ``kinds`` (default: every seed);
    yields (kind of seed, description of the corruption, :class:`Outcome`). DFlash drafters
    load against the uncorrupted ``gguf`` seed, which must then be among ``seeds``."""
    rng = random.Random(seed)
    kinds = sorted(kinds or seeds)
    target = load_target(seeds, os.path.join(root, "target")) if "dflash" in kinds else None
    for i in range(cases):
        s = seeds[kinds[i % len(kinds)]]
        files, what = mutate(s, rng)
        yield s.kind, what, run_case(s, files, os.path.join(root, "case"), target, time_limit)
