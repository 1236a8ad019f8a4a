"""Training prompts written by the target itself (self-instruct), for drafter training (issue 9).

The shipped chat and code prompts are templates over hand-written lists (scripts/make_train_prompts.py):
broad, but every one reads like its template. Here the target is asked, through its chat template, to
write a request a user might send it, about a topic and of a kind drawn from those same lists, and sampled
(temperature 0.7 by default), so the prompts are as varied as the target's own writing. The replies are
cleaned (the first paragraph, labels and quotes dropped), filtered (length, words), deduplicated
(case and spacing), and any that equals, contains or is contained in a test-set text is dropped: the
test sets (gsm8k_test, humaneval, mt_bench) are read only for that. Generation is the batched serving
loop (``generate_batch``), so it is fast on a GPU.

    python scripts/make_self_instruct.py --num 20000 --out self_instruct_prompts.jsonl [--target M.gguf]

The output is a ``{"prompt": ...}`` .jsonl that ``specdec train --prompts`` reads, written whole or not
at all; the run's settings go to stderr and, with ``--provenance F``, to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_train_prompts as lists  # noqa: E402  (the topic and subject lists, written by hand)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "specdec", "data", "bench")

CHAT_KINDS = ["question", "request for an explanation", "creative writing request", "request for advice",
              "request for a comparison", "step-by-step how-to request", "request for a list of ideas",
              "request to write an email or letter", "role-play request", "request for a short story",
              "request for a summary", "opinion question", "request for a poem", "request for a plan",
              "trivia question", "request to rewrite a sentence", "request for pros and cons"]
CODE_KINDS = ["programming task", "request to write a function", "request to fix a bug", "request to explain code",
              "request to write tests", "question about an algorithm", "request for a small script"]
META_CHAT = ["Write one {kind} about {topic} that a user might send to an AI assistant. Write only the request itself.",
             "Invent a {kind} about {topic}, as a curious person would type it into a chatbot. Reply with that text only."]
META_CODE = ["Write one {kind} in {lang} about {subject} that a programmer might send to an AI assistant. "
             "Write only the request itself.",
             "Invent a {kind} for {lang} involving {subject}, as a developer would ask it. Reply with that text only."]
LABEL = re.compile(r"^\s*(?:(?:user|request|question|prompt|task|here is [^:]*|sure[^:]*)\s*:\s*)+", re.I)


def meta_prompts(n: int, rng: random.Random, code_share: float = 0.35) -> list[str]:
    """``n`` instructions to the target, each asking for one request of a drawn kind and subject."""
    topics = [t for field in lists.TOPICS.values() for t in field]
    subjects = ([f[0].replace("_", " ") for f in lists.FUNCS] + list(lists.CONCEPTS) + list(lists.ALGO))
    langs = ["Python"] * 4 + list(lists.LANGS) + ["SQL", "Bash"]
    out = []
    for _ in range(n):
        if rng.random() < code_share:
            out.append(rng.choice(META_CODE).format(kind=rng.choice(CODE_KINDS), lang=rng.choice(langs),
                                                    subject=rng.choice(subjects)))
        else:
            out.append(rng.choice(META_CHAT).format(kind=rng.choice(CHAT_KINDS), topic=rng.choice(topics)))
    return out


def clean(text: str, min_chars: int = 20, max_chars: int = 600) -> str | None:
    """The request in a reply, or None: its first paragraph, a leading label ("Question:", "Sure, here
    is ...:") and enclosing quotes removed, spaces collapsed; None when too short or long, with fewer
    than 4 words, or not ending like a sentence."""
    para = text.strip().split("\n\n")[0].strip()
    para = LABEL.sub("", para).strip()
    if len(para) >= 2 and para[0] in "\"'“" and para[-1] in "\"'”":
        para = para[1:-1].strip()
    para = " ".join(para.split())
    if not (min_chars <= len(para) <= max_chars) or len(para.split()) < 4 or para[-1] not in ".?!":
        return None
    return para


def test_texts() -> list[str]:
    """Every question, prompt and turn of the three test sets (read only to keep them out)."""
    texts = []
    for name, get in (("gsm8k_test.jsonl", lambda r: [r["question"]]), ("humaneval.jsonl", lambda r: [r["prompt"]]),
                      ("mt_bench.jsonl", lambda r: r["turns"])):
        with open(os.path.join(BENCH, name), encoding="utf-8") as fh:
            texts += [" ".join(t.split()).lower() for line in fh if line.strip() for t in get(json.loads(line))]
    return texts


def select(replies: list[str], exclude: list[str], limit: int) -> tuple[list[str], dict]:
    """Cleaned, deduplicated replies that share no text with ``exclude`` (normalised), at most ``limit``."""
    joined = "\0".join(exclude)
    seen, out = set(), []
    counts = {"replies": len(replies), "unusable": 0, "duplicates": 0, "test_overlap": 0}
    for r in replies:
        p = clean(r)
        if p is None:
            counts["unusable"] += 1
            continue
        key = p.lower()
        if key in seen:
            counts["duplicates"] += 1
            continue
        if key in joined or any(t in key for t in exclude):
            counts["test_overlap"] += 1
            continue
        seen.add(key)
        out.append(p)
        if len(out) >= limit:
            break
    counts["kept"] = len(out)
    return out, counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", "-m", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--num", type=int, required=True, help="prompts to write (at most; the filter may keep fewer)")
    ap.add_argument("--oversample", type=float, default=1.6, help="requests generated per prompt wanted (default 1.6)")
    ap.add_argument("--out", required=True, help="output .jsonl")
    ap.add_argument("--provenance", default=None, help="also write the run's settings and counts to this JSON file")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7: at 1 SmolLM2-135M rambles)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    if a.num < 1 or a.oversample < 1 or a.temperature < 0 or a.max_new_tokens < 8:
        ap.error("need --num >= 1, --oversample >= 1, --temperature >= 0, --max-new-tokens >= 8")
    if not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        ap.error(f"--out {a.out}: its folder does not exist")
    from specdec.api import default_model_path
    from specdec.engine.batch import generate_batch, reply_progress
    from specdec.errors import SpecdecError
    from specdec.loading import load_model

    target = a.target or default_model_path()
    try:
        loaded = load_model(target, a.device, None)
    except SpecdecError as e:
        print(f"make_self_instruct: {e}", file=sys.stderr)
        return 2
    tok = loaded.tokenizer
    if tok is None or not tok.chat_template:
        print(f"make_self_instruct: {target}: needs a tokenizer with a chat template", file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    metas = meta_prompts(int(a.num * a.oversample), rng)
    enc = [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}]), add_special=False) for m in metas]
    bar, on_done, _ = reply_progress(len(enc), "writing requests", "request")
    t0 = time.perf_counter()
    ids = generate_batch(loaded.model, enc, a.max_new_tokens, set(tok.eos_ids), slots=a.slots,
                         temperature=a.temperature, seed=a.seed, on_done=on_done)
    secs = time.perf_counter() - t0
    bar.close()
    replies = [tok.decode([t for t in r if t not in tok.eos_ids]) for r in ids]
    prompts, counts = select(replies, test_texts(), a.num)
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")
    os.replace(tmp, a.out)
    info = {"target": os.path.basename(target), "seed": a.seed, "temperature": a.temperature,
            "max_new_tokens": a.max_new_tokens, "requested": a.num, "generated": len(metas),
            "generated_tokens": sum(len(r) for r in ids), "seconds": round(secs, 1), **counts,
            "device": str(loaded.model.device)}
    print(json.dumps(info), file=sys.stderr)
    if a.provenance:
        with open(a.provenance, "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
