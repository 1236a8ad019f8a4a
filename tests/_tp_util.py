"""What each tensor-parallel rank runs in tests/test_tp.py. Spawned ranks import this module by
name, so it imports only specdec (no pytest, no transformers)."""

from __future__ import annotations

import os

from specdec import LLM, load_target


def logits_on_rank(shard, cases: list[tuple[str, list[int]]]) -> list:
    """fp32 logits ``[T, V]`` of each case's ids under its target."""
    return [load_target(path, shard=shard).logits(ids) for path, ids in cases]


def generate_on_rank(shard, path: str, drafts: list[str], prompts: list[list[int]], n: int,
                     references: list[list[int]] | None = None) -> dict:
    """Greedy token ids per drafter spec ("none": plain decoding); with ``references`` (prompt +
    plain continuation), also a spoiled oracle's ids and how many of its drafts were accepted
    (drafts that get accepted, so the sharded verify and rollback really run); with the last
    drafter, one reply sampled with a seed and one without (the ranks must agree on a seed, or
    their forwards would part ways)."""
    from _engine_util import SpoiledOracle

    out = {}
    if references:
        vocab = LLM(path, shard=shard).model.config.vocab_size
        out["oracle"], out["oracle accepted"] = [], 0
        for ref, p in zip(references, prompts):
            oracle = SpoiledOracle(ref, vocab, spoil=0.3)
            res = LLM(path, draft=oracle, shard=shard, num_draft_tokens=3).generate(p, n)
            out["oracle"].append(res.token_ids)
            out["oracle accepted"] += sum(res.stats.accepted)
    for spec in drafts:
        llm = LLM(path, draft=spec, shard=shard, num_draft_tokens=3)
        out[spec] = [llm.generate(p, n).token_ids for p in prompts]
    out["seed 5"] = llm.generate(prompts[0], n, temperature=1.0, seed=5).token_ids
    out["no seed"] = llm.generate(prompts[0], n, temperature=1.0).token_ids
    return out


def load_on_rank(shard, paths: list[str], ids: list[int]):
    """Rank r loads ``paths[r]`` (a broken one fails that rank alone), then runs a forward."""
    return load_target(paths[shard.rank], shard=shard).logits(ids)


def children(pid: int | None = None) -> list[tuple[int, str]]:
    """Live child processes of ``pid`` (default: this one) as (pid, command line), multiprocessing's
    resource tracker left out."""
    pid = os.getpid() if pid is None else pid
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z" and "resource_tracker" not in cmd:
            out.append((int(d), cmd))
    return out


def crash_on_rank(shard):
    """Rank 1 dies without a word (a crash); rank 0 waits for it in an all-reduce."""
    import torch

    if shard.rank == 1:
        os._exit(3)
    return shard.all_reduce(torch.ones(1))
