"""``specdec train dflash|mtp``: load the target, distil its replies, train, write the drafter."""

from __future__ import annotations

import json
import os
import random
import shlex
import sys

import torch

from ..drafters.draft_vocab import token_counts_vocab
from ..drafters.factory import VOCAB_FILE
from ..errors import ConfigError
from .data import branch, distill, read_prompts
from .trainer import Stopped, TrainConfig, train

DEFAULT_PROMPTS = ("gsm8k_train", "chat", "code", "self_instruct")


def check_args(a) -> None:
    """Refuse bad numbers before anything is loaded."""
    for name, v in (("--epochs", a.epochs), ("--lr", a.lr)):
        if not v > 0:
            raise ConfigError(f"{name} must be > 0, got {v}")
    for name, v, lo in (("--batch-tokens", a.batch_tokens, 1),
                        ("--max-new-tokens", a.max_new_tokens, 1), ("--slots", a.slots, 1),
                        ("--eval-prompts", a.eval_prompts, 0), ("--eval-tokens", a.eval_tokens, 1),
                        ("--temperature", a.temperature, 0), ("--warmup", a.warmup, 0),
                        ("--draft-vocab-size", a.draft_vocab_size, 0), ("--branches", a.branches, 0)):
        if not v >= lo:
            raise ConfigError(f"{name} must be >= {lo:g}, got {v}")
    if a.branches and a.temperature > 0:
        raise ConfigError("--branches continues greedy replies: it needs --temperature 0")
    if a.warmup >= 1:
        raise ConfigError(f"--warmup is a fraction of the steps in [0, 1), got {a.warmup}")
    if a.max_prompts is not None and a.max_prompts < 1:
        raise ConfigError(f"--max-prompts must be >= 1, got {a.max_prompts}")
    if a.kind == "dflash":
        if a.block_size is not None and not 2 <= a.block_size <= 64:
            raise ConfigError(f"--block-size must be in 2..64, got {a.block_size}")
        if (a.layers is not None and a.layers < 1) or a.anchors < 1:
            raise ConfigError("--layers and --anchors must be >= 1")
    if a.init is not None:
        if not os.path.isfile(os.path.join(a.init, "config.json")):
            raise ConfigError(f"--init {a.init}: not a drafter directory (no config.json)")
        if a.kind == "dflash" and (a.layers is not None or a.block_size is not None or a.mask_token_id is not None):
            raise ConfigError("--init keeps the drafter's architecture: drop --layers/--block-size/--mask-token-id")
    if a.kind == "mtp" and not 1 <= a.steps <= 8:
        raise ConfigError(f"--steps (chained MTP steps trained) must be in 1..8, got {a.steps}")
    for name, v in (("--time-limit", a.time_limit), ("--minutes", getattr(a, "minutes", None))):
        if v is not None and not v > 0:
            raise ConfigError(f"{name} must be > 0 minutes, got {v}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise ConfigError(f"--out {a.out}: exists and is not a directory")


def run_train(a, argv: list[str] | None = None) -> int:
    from ..api import default_model_path
    from ..loading import load_model
    from .tasks import make_task

    check_args(a)
    texts: list[str] = []
    for name in a.prompts or DEFAULT_PROMPTS:
        texts.extend(read_prompts(name))
    rng = random.Random(a.seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    if a.max_prompts is not None:
        order = order[: a.max_prompts + a.eval_prompts]
    held = [texts[i] for i in order[: a.eval_prompts]]
    texts = [texts[i] for i in order[a.eval_prompts:]]
    if not texts:
        raise ConfigError("no training prompts left after setting aside --eval-prompts")

    target_path = a.target or default_model_path()
    loaded = load_model(target_path, a.device, a.dtype)
    tok = loaded.tokenizer
    if tok is None:
        raise ConfigError(f"{target_path}: training needs a tokenizer")
    task = None if a.distill_only else make_task(a, loaded)  # a bad drafter setting fails before distilling
    cache_dir = os.path.expanduser(a.data_cache)
    data = distill(loaded, texts, max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
                   slots=a.slots, cache_dir=cache_dir, chat=not a.no_chat)
    print(f"data: {len(data.prompts)} prompts, {data.reply_tokens} reply tokens (cache {cache_dir})", file=sys.stderr)
    if a.branches:
        more = branch(loaded, data, a.branches, max_new_tokens=a.max_new_tokens, seed=a.seed, slots=a.slots,
                      cache_dir=cache_dir, batch_tokens=a.batch_tokens)
        print(f"branches: {len(more.prompts)} more replies, {more.reply_tokens} reply tokens", file=sys.stderr)
        data = data + more
    if a.distill_only:  # the replies' draft vocabulary alone (e.g. for a target's own MTP block: --draft-vocab FILE)
        vocab = draft_vocab_json(data, loaded.model.config.vocab_size, a.draft_vocab_size, tok.eos_ids)
        if vocab:
            os.makedirs(a.out, exist_ok=True)
            path = os.path.join(a.out, VOCAB_FILE)
            with open(path + ".tmp", "w", encoding="utf-8") as fh:
                fh.write(vocab)
            os.replace(path + ".tmp", path)
            print(f"draft vocabulary: {path}", file=sys.stderr)
        return 0
    eval_ids = [tok.encode(t, add_special=True) if a.no_chat else
                tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special=False) for t in held]
    cfg = TrainConfig(epochs=a.epochs, lr=a.lr, warmup=a.warmup, batch_tokens=a.batch_tokens, seed=a.seed,
                      checkpoint_minutes=a.checkpoint_minutes, time_limit_minutes=a.time_limit,
                      minutes=getattr(a, "minutes", None),
                      eval_prompts=eval_ids, eval_tokens=a.eval_tokens)
    argv = getattr(a, "argv", None) if argv is None else argv
    command = "specdec " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    vocab = draft_vocab_json(data, loaded.model.config.vocab_size, a.draft_vocab_size, tok.eos_ids)
    task.extra_files = {VOCAB_FILE: vocab} if vocab else {}  # written with the drafter, in its directory
    task.provenance = {"command": command, "target": os.path.basename(target_path),
                       "prompts": [os.path.basename(p) for p in (a.prompts or DEFAULT_PROMPTS)],
                       "train_prompts": len(texts), "held_out_prompts": len(held), "max_new_tokens": a.max_new_tokens,
                       "temperature": a.temperature, "seed": a.seed,
                       "branches": a.branches}
    try:
        summary = train(task, loaded, data, a.out, cfg, restart=a.restart, log=lambda m: print(m, file=sys.stderr))
    except Stopped as e:
        print(f"specdec train: {e}", file=sys.stderr)
        return 3
    print(json.dumps({"out": a.out, **{k: summary[k] for k in ("steps", "seconds", "last_epoch_loss", "held_out_tau")}}))
    return 0


def draft_vocab_json(data, vocab_size: int, size: int, always=()) -> str | None:
    """The drafter's ``draft_vocab.json`` (:mod:`specdec.drafters.draft_vocab`): the ``size`` tokens its
    training replies use most, ties and the never-used by id (BPE ids run roughly from frequent to
    rare), the stop tokens always. None when ``size`` is 0 or covers the vocabulary."""
    if not 0 < size < vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for r in data.replies:
        counts += torch.bincount(torch.tensor(r, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    ids = token_counts_vocab(counts, size, [t for t in always if 0 <= t < vocab_size])
    return json.dumps({"token_ids": ids, "made_from": f"{int(counts.sum())} reply tokens of the training data"}) + "\n"
