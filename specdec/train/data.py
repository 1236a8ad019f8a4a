"""Training data by self-distillation: the target answers the prompts, the drafter learns the
answers. Replies are cached on disk as token ids, so a rerun (or a resumed run) never
regenerates them; the cache is keyed by the target file, the prompts and the decoding settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from ..bench import PACKAGED_DATA, find_data_dir
from ..errors import ConfigError

GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# short names for the prompt sets shipped with the package
TRAIN_SETS = {"gsm8k_train": ("bench", "gsm8k_train.jsonl"), "chat": ("train", "chat_prompts.jsonl"),
              "code": ("train", "code_prompts.jsonl"), "self_instruct": ("train", "self_instruct_prompts.jsonl"),
              "math": ("train", "math_prompts.jsonl"), "functions": ("train", "function_prompts.jsonl")}


def resolve_prompt_file(name: str) -> str:
    if os.path.isfile(name):
        return name
    if name in TRAIN_SETS:
        sub, fname = TRAIN_SETS[name]
        folder = find_data_dir() if sub == "bench" else os.path.join(os.path.dirname(PACKAGED_DATA), "train")
        path = os.path.join(folder, fname)
        if os.path.isfile(path):
            return path
        raise ConfigError(f"{path}: the shipped prompt set '{name}' is missing from this install")
    raise ConfigError(f"--prompts {name}: no such file (give .jsonl/.txt files or one of {', '.join(TRAIN_SETS)})")


def read_prompts(name: str) -> list[str]:
    """User prompts of one file: JSON lines with ``prompt``, ``question`` (GSM8K, asked as the
    benchmark asks it), ``instruction`` or ``turns`` (the first turn); or plain text, one per line."""
    path = resolve_prompt_file(name)
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            if not path.endswith(".jsonl"):
                out.append(line)
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(r, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object")
            if isinstance(r.get("prompt"), str):
                out.append(r["prompt"])
            elif isinstance(r.get("question"), str):
                out.append(r["question"] + GSM8K_SUFFIX)
            elif isinstance(r.get("instruction"), str):
                out.append(r["instruction"])
            elif isinstance(r.get("turns"), list) and r["turns"] and isinstance(r["turns"][0], str):
                out.append(r["turns"][0])
            else:
                raise ConfigError(f"{path}:{lineno}: record without a string 'prompt', 'question', 'instruction' or 'turns'")
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


@dataclass
class Distilled:
    prompts: list[list[int]]  # prompt token ids (chat template applied)
    replies: list[list[int]]  # the target's replies (ending with a stop token unless cut at max_new_tokens)
    key: str = ""  # the reply cache's key (decoding settings and target)

    def __add__(self, other: "Distilled") -> "Distilled":
        return Distilled(self.prompts + other.prompts, self.replies + other.replies, self.key)

    def sequences(self) -> list[tuple[list[int], int]]:
        """(prompt + reply, index of the first reply token) per example with a non-empty reply."""
        return [(p + r, len(p)) for p, r in zip(self.prompts, self.replies) if r]

    @property
    def reply_tokens(self) -> int:
        return sum(len(r) for r in self.replies)


def target_fingerprint(path: str) -> str:
    """A content fingerprint of a checkpoint (stable across copies, unlike a path or mtime): the
    size and the first and last MiB of every file (a GGUF file, or an HF directory's files)."""
    single = os.path.isfile(path)
    files = [path] if single else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith((".json", ".safetensors", ".gguf")))
    h = hashlib.sha256()
    for f in files:
        size = os.path.getsize(f)
        # a directory's file names are part of its content; a single file's own name is not
        h.update(f"{'' if single else os.path.basename(f)}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:16]


def prompt_key(ids: list[int]) -> int:
    """A 63-bit key of a prompt's token ids (the reply cache is indexed by it)."""
    d = hashlib.sha256(json.dumps(ids).encode()).digest()
    return int.from_bytes(d[:8], "little") & ((1 << 63) - 1)


def distill(loaded, texts: list[str], *, max_new_tokens: int, temperature: float, seed: int, slots: int,
            cache_dir: str, chat: bool = True, chunk: int = 2048) -> Distilled:
    """The target's replies to ``texts``, from the cache when present. Generated in chunks of
    ``chunk`` prompts, each saved as it ends, so an interrupted run keeps what it made."""
    tok, model = loaded.tokenizer, loaded.model
    if tok is None:
        raise ConfigError(f"{loaded.path}: training needs a tokenizer (the target has none)")
    enc = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]) if chat else t, add_special=not chat)
           for t in texts]
    limit = model.max_context - max_new_tokens
    too_long = [i for i, e in enumerate(enc) if len(e) > limit]
    if too_long:
        raise ConfigError(f"prompt {too_long[0]} is {len(enc[too_long[0]])} tokens: more than the context "
                          f"({model.max_context}) minus --max-new-tokens ({max_new_tokens})")
    # one cache file per target and decoding settings, indexed by prompt: any subset or split of
    # the prompts (another --max-prompts or --eval-prompts) reuses what was made
    key = _settings_key(loaded, max_new_tokens, temperature, seed)
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"replies-{key}.pt")
    replies = _cached_replies(model, enc, [max_new_tokens] * len(enc), tok.eos_ids, path, ("distilling", "distilled"),
                              temperature=temperature, seed=seed, slots=slots, chunk=chunk)
    return Distilled(enc, replies, key)


def _settings_key(loaded, max_new_tokens: int, temperature: float, seed: int) -> str:
    """The reply cache's key: the target's content, its dtype and the decoding settings."""
    return hashlib.sha256(json.dumps([target_fingerprint(loaded.path), str(loaded.model.dtype), max_new_tokens,
                                      temperature, seed, sorted(loaded.tokenizer.eos_ids)]).encode()).hexdigest()[:16]


def _cached_replies(model, enc: list[list[int]], budgets: list[int], stop_ids, path: str, words: tuple[str, str], *,
                    temperature: float, seed: int, slots: int, chunk: int) -> list[list[int]]:
    """The replies to ``enc`` (prompt ``i`` continued by at most ``budgets[i]`` tokens) from the cache file
    ``path``, generating and saving the missing ones in chunks of ``chunk`` prompts; ``words``: the progress
    bar's label and the verb of the summary line."""
    from ..engine.batch import generate_batch, reply_progress

    done = _load_replies(path) if os.path.exists(path) else {}
    keys = [prompt_key(e) for e in enc]
    todo = [i for i in range(len(enc)) if keys[i] not in done]
    if todo:
        bar, on_done, ntok = reply_progress(len(enc), words[0], "prompt", initial=len(enc) - len(todo))
        t0 = time.perf_counter()
        for c in range(0, len(todo), chunk):
            part = todo[c:c + chunk]
            replies = generate_batch(model, [enc[i] for i in part], [budgets[i] for i in part], set(stop_ids),
                                     slots=slots, temperature=temperature, seed=seed + c, on_done=on_done)
            done.update(zip((keys[i] for i in part), replies))
            _save_replies(path, done)
        bar.close()
        secs = time.perf_counter() - t0
        print(f"{words[1]} {len(todo)} replies (cached in {path}), "
              f"{ntok[0]} tokens in {secs:.1f} s ({ntok[0] / max(secs, 1e-9):.0f} tok/s)", file=sys.stderr)
    return [done[k] for k in keys]


BRANCH_TOP_K = 10  # a branch's token is one of the target's 10 likeliest after its greedy one


def branch(loaded, base: Distilled, n: int, *, max_new_tokens: int, seed: int, slots: int, cache_dir: str,
           batch_tokens: int = 16384, chunk: int = 2048) -> Distilled:
    """``n`` more training replies per reply of ``base`` (greedy replies: ``base.key`` names their cache).

    Each branch of a reply ``r`` starts at a random position ``p`` of it (``n`` distinct ones in ``0 .. len(r) - 2``):
    its prompt is the base prompt, ``r[:p]`` and a token ``x`` the target did not choose there (drawn from
    its distribution at ``p`` at temperature 1, less ``r[p]`` and the stop tokens, among its ``BRANCH_TOP_K``
    likeliest); its reply is the target's greedy continuation of that, by at most ``max_new_tokens - p - 1``
    tokens. So every reply token is still the target's greedy choice after what precedes it (what
    verification checks a draft against), from contexts that greedy decoding of the training prompts alone
    would never reach: more data of the same kind, for no new prompts. Only the continuation is trained on
    (``Distilled.sequences``).

    The branch points and tokens are drawn once (one forward of every reply, ``batch_tokens`` at a time)
    and cached by base prompt with the continuations in ``cache_dir`` (keyed by the base replies' settings,
    ``n`` and ``seed``): any subset of the prompts reuses them, new ones get theirs drawn."""
    model, stop = loaded.model, set(loaded.tokenizer.eos_ids)
    if n < 1:
        return Distilled([], [], base.key)
    key = hashlib.sha256(json.dumps(["branch-1", base.key, n, seed]).encode()).hexdigest()[:16]
    spec_path = os.path.join(cache_dir, f"branches-{key}.pt")
    src = [i for i, r in enumerate(base.replies) if len(r) >= 2]
    keys = {i: prompt_key(base.prompts[i]) for i in src}
    spec: dict[int, list[tuple[int, int]]] = {}  # base prompt key -> its branches' (p, x)
    if os.path.exists(spec_path):
        try:
            d = torch.load(spec_path, weights_only=True)
            for k, p, x in zip(d["source"].tolist(), d["p"].tolist(), d["x"].tolist()):
                spec.setdefault(k, []).append((p, x))
        except Exception as e:  # noqa: BLE001 - an unreadable cache is reported, never trusted
            raise ConfigError(f"{spec_path}: unreadable branch cache ({e}); delete it to draw again") from None
    need = [i for i in src if keys[i] not in spec]
    if need:  # replies of prompts not seen before (any subset or split of the prompts reuses what was drawn)
        for i, p, x in _draw_branches(model, base, need, n, stop, seed, batch_tokens):
            spec.setdefault(keys[i], []).append((p, x))
        flat = [(k, p, x) for k in sorted(spec) for p, x in spec[k]]
        tmp = spec_path + ".tmp"
        torch.save({name: torch.tensor([r[j] for r in flat], dtype=torch.int64)
                    for j, name in enumerate(("source", "p", "x"))}, tmp)
        os.replace(tmp, spec_path)
    rows = [(i, p, x) for i in src for p, x in spec[keys[i]]]
    if any(not 0 <= p <= len(base.replies[i]) - 2 for i, p, _ in rows):
        raise ConfigError(f"{spec_path}: branch points outside these replies; delete it to draw again")
    enc = [base.prompts[i] + base.replies[i][:p] + [x] for i, p, x in rows]
    budgets = [max_new_tokens - p - 1 for _, p, _ in rows]
    replies = _cached_replies(model, enc, budgets, stop, os.path.join(cache_dir, f"branch-replies-{key}.pt"),
                              ("branching", "continued"), temperature=0.0, seed=seed, slots=slots, chunk=chunk)
    return Distilled(enc, replies, key)


@torch.no_grad()
def _draw_branches(model, base: Distilled, src: list[int], n: int, stop: set[int], seed: int,
                   batch_tokens: int) -> list[tuple[int, int, int]]:
    """``(source reply, p, x)`` for ``n`` branches of each reply in ``src`` (see :func:`branch`)."""
    from tqdm.auto import tqdm

    from .trainer import collate, make_batches

    rng = random.Random(seed)
    picks = {i: sorted(rng.sample(range(len(base.replies[i]) - 1), min(n, len(base.replies[i]) - 1))) for i in src}
    seqs = [(base.prompts[i] + base.replies[i], len(base.prompts[i])) for i in src]
    gen = torch.Generator(device=model.device).manual_seed(seed)
    banned = torch.tensor(sorted(stop), dtype=torch.long, device=model.device)
    rows = []
    for batch in tqdm(make_batches(seqs, batch_tokens, 1 << 30), desc="branch points", unit="batch"):
        ids, _ = collate(seqs, batch, 1 << 30, model.device)
        hidden = model.forward_batch_train(ids).hidden  # [b, L, H]
        where = [(r, src[j], p) for r, j in enumerate(batch) for p in picks[src[j]]]
        b_idx = torch.tensor([r for r, _, _ in where], device=model.device)
        # the hidden state before reply token p predicts it
        t_idx = torch.tensor([len(base.prompts[i]) + p - 1 for _, i, p in where], device=model.device)
        logits = model.head(hidden[b_idx, t_idx], exact=False)  # [m, V] fp32
        chosen = torch.tensor([base.replies[i][p] for _, i, p in where], device=model.device)
        logits[torch.arange(len(where), device=model.device), chosen] = float("-inf")
        logits[:, banned] = float("-inf")
        top = logits.topk(BRANCH_TOP_K, dim=-1)  # the likeliest alternatives only: no token from the far tail
        pick = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
        x = top.indices.gather(1, pick)[:, 0].tolist()
        rows.extend((i, p, t) for (_, i, p), t in zip(where, x))
    rows.sort()
    return rows


def _save_replies(path: str, done: dict[int, list[int]]) -> None:
    """Replies (by prompt key) as one flat tensor with lengths, atomically: 2 bytes a token where
    every id fits 16 bits (stored as int16 less 32768: vocabularies up to 65,536), else 4."""
    idx = sorted(done)
    flat = torch.tensor([t for i in idx for t in done[i]], dtype=torch.int64)
    small = flat.numel() == 0 or (int(flat.min()) >= 0 and int(flat.max()) < 1 << 16)
    tokens = (flat - (1 << 15)).to(torch.int16) if small else flat.to(torch.int32)
    tmp = path + ".tmp"
    torch.save({"index": torch.tensor(idx, dtype=torch.int64), "lengths": torch.tensor([len(done[i]) for i in idx]),
                "tokens": tokens, "offset": (1 << 15) if small else 0}, tmp)
    os.replace(tmp, path)


def _load_replies(path: str) -> dict[int, list[int]]:
    try:
        d = torch.load(path, weights_only=True)
        toks = (d["tokens"].to(torch.int64) + int(d.get("offset", 0))).tolist()
        out, at = {}, 0
        for i, n in zip(d["index"].tolist(), d["lengths"].tolist()):
            out[i] = toks[at:at + n]
            at += n
        if at != len(toks):
            raise ValueError("lengths do not add up")
        return out
    except Exception as e:  # noqa: BLE001 - any unreadable cache is reported, never trusted
        raise ConfigError(f"{path}: unreadable reply cache ({e}); delete it to regenerate") from None
