"""``specdec bench``: drafters side by side on the same prompts, in one process.

Every configuration runs on every prompt, interleaved prompt by prompt so that machine noise
hits them alike. With greedy decoding each configuration's output is also compared token for
token with the no-drafter baseline: a mismatch is reported (it would be a correctness bug, or
floating-point non-associativity between the 1-token and (k+1)-token forwards in low precision).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from . import cpu_linear
from .drafters.factory import make_drafter
from .engine import SpeculativeGenerator
from .errors import ConfigError
from .loading import load_model
from .sampling import SamplingParams

DATASETS = {"gsm8k": "gsm8k_test.jsonl", "humaneval": "humaneval.jsonl", "mt_bench": "mt_bench.jsonl"}
# the prompt sets shipped inside the package (package data), used when no folder is named
PACKAGED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bench")


def find_data_dir(explicit: str | None = None) -> str:
    """The folder with the prompt sets: ``explicit``, else ``$SPECDEC_BENCH_DATA``, else the shipped sets."""
    for what, c in (("data_dir/--data-dir", explicit), ("$SPECDEC_BENCH_DATA", os.environ.get("SPECDEC_BENCH_DATA"))):
        if c:
            if not os.path.isdir(c):
                raise ConfigError(f"{c}: no such directory (given as {what}; the folder with gsm8k_test.jsonl ...)")
            return c
    if os.path.isdir(PACKAGED_DATA):
        return PACKAGED_DATA
    raise ConfigError(f"bench data not found (this install lacks {PACKAGED_DATA}): pass --data-dir or set "
                      "SPECDEC_BENCH_DATA (the folder with gsm8k_test.jsonl ...)")


def load_prompts(dataset: str, n: int, data_dir: str | None = None) -> list[list[str]]:
    """Up to ``n`` prompts as lists of user turns (one turn except MT-Bench), in the DFlash benchmark's formats."""
    if dataset not in DATASETS and not os.path.isfile(dataset):
        raise ConfigError(f"dataset '{dataset}': expected one of {', '.join(DATASETS)} or a .jsonl file with 'prompt', 'turns' or 'question' (GSM8K's format) in each record")
    path = dataset if os.path.isfile(dataset) else os.path.join(find_data_dir(data_dir), DATASETS[dataset])
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file (the {dataset} prompt set)")
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if len(out) >= n:
                break
            if line.strip():
                out.append(_turns(line, dataset, f"{path}:{lineno}"))
    return out


def _turns(line: str, dataset: str, where: str) -> list[str]:
    """The user turns of one JSON-lines record of ``dataset``; errors name the file and line."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    field = {"gsm8k": "question", "humaneval": "prompt"}.get(dataset)
    if not isinstance(r, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if field is not None and field not in r:
        raise ConfigError(f"{where}: {dataset} record without '{field}'")
    if dataset == "gsm8k":
        return [f"{r['question']}\nPlease reason step by step, and put your final answer within \\boxed{{}}."]
    if dataset == "humaneval":
        return [f"Write a solution to the following problem and make sure that it passes the tests:\n```python\n{r['prompt']}\n```"]
    if "turns" in r:
        turns = r["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ConfigError(f"{where}: 'turns' must be a non-empty list of strings")
        return list(turns)
    if "prompt" in r:
        if not isinstance(r["prompt"], str):
            raise ConfigError(f"{where}: 'prompt' must be a string")
        return [r["prompt"]]
    if "question" in r and isinstance(r["question"], str):  # a GSM8K-format file (gsm8k_train.jsonl): GSM8K's prompt
        return _turns(line, "gsm8k", where)
    raise ConfigError(f"{where}: record without 'turns', 'prompt' or 'question'")


@dataclass
class ConfigResult:
    draft: str
    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    mismatches: int = 0
    # where the time went (engine Stats, summed): the prefill (and the drafter's begin), the host
    # side of proposing (on CUDA the device work it launches is waited for in the verify), the
    # verify step with the step's one sync
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_configs(drafts: list[str], ks, block_sizes) -> list[tuple[str, str, int, int | None]]:
    """``(label, spec, k, block_size)`` per configuration: every k-drafter (ngram, mtp) once per
    ``ks`` entry, every DFlash drafter once per ``block_sizes`` entry (labels say which)."""
    ks = list(ks) if isinstance(ks, (list, tuple)) else [ks]
    bss = list(block_sizes) if isinstance(block_sizes, (list, tuple)) else [block_sizes]
    out = []
    for spec in drafts:
        if spec == "none":
            out.append(("none", spec, 0, None))
        elif spec.startswith("dflash"):
            out += [(spec if len(bss) == 1 else f"{spec} bs={bs}", spec, 0, bs) for bs in bss]
        else:
            out += [(spec if len(ks) == 1 else f"{spec} k={k}", spec, k, None) for k in ks]
    return out


def run_bench(model: str, drafts: list[str], dataset: str, num_prompts: int, max_new_tokens: int, *,
              num_draft_tokens=4, block_size=None, temperature: float = 0.0,
              device=None, dtype=None, data_dir: str | None = None, chat: bool = True, seed: int = 0,
              cuda_graphs: bool = True, batch_invariant: bool | None = None, compile: bool = False,
              max_turns: int | None = None, shard=None, draft_vocab: str | None = None,
              draft_int8: bool = False) -> dict:
    """``num_draft_tokens`` / ``block_size``: a value or a list (a sweep: one configuration each).
    ``draft_int8``: each DFlash configuration run twice, the second on int8 weights (``label int8``).
    ``shard``: run as one tensor-parallel rank (every rank runs the same bench)."""
    prompts = load_prompts(dataset, num_prompts, data_dir)  # a missing prompt set fails before loading
    if max_turns is not None:
        prompts = [turns[:max_turns] for turns in prompts]
    loaded = load_model(model, shard.device if shard else device, dtype, shard=shard)
    tgt, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise ConfigError(f"{model}: bench needs a tokenizer")
    gens = {}
    configs = [(*c, False) for c in bench_configs(drafts, num_draft_tokens, block_size)]
    if draft_int8:  # each DFlash configuration again on int8 weights
        configs += [(f"{label} int8", spec, k, bs, True) for label, spec, k, bs, _ in configs if spec.startswith("dflash")]
    for label, spec, k, bs, int8 in configs:
        d = make_drafter(spec, loaded, block_size=bs if spec.startswith("dflash") else None,
                         draft_vocab=draft_vocab if draft_vocab and spec not in ("none", "ngram") else None,
                         draft_int8=int8)
        if d is not None and getattr(d, "block_size", None):
            k = d.block_size - 1
        gens[label] = SpeculativeGenerator(tgt, d, k, cuda_graphs=cuda_graphs, batch_invariant=batch_invariant,
                                           compile=compile)
    drafts = list(gens)
    results = {spec: ConfigResult(spec) for spec in drafts}
    params = SamplingParams(temperature=temperature, seed=seed)

    def encode(messages: list[dict]) -> list[int]:  # a turn's prompt ids (the chat so far, or the last turn alone)
        return tok.encode(tok.apply_chat_template(messages) if chat else messages[-1]["content"], add_special=not chat)

    # warm-up (allocator, kernels, captured steps), not timed: the first prompt, so that each configuration's static
    # prefill captures its wide chunk step here (on the H200 a configuration's first pass over prompts of more than 16
    # tokens cost ~0.25 s more prefill after a "Hello" warm-up: scripts/probe_gc.py, session of 2026-12-05 (fourth))
    # On CUDA it decodes as far as a timed prompt may: the attention's steps are captured per span of live context, so
    # a short warm-up leaves captures in the first timed prompts (generate --compare's 4-token one did: 0.76-1.10x
    # plain on the H100 where this bench measured 2.2x; over 100 prompts here the cost is smaller, not measured).
    # On the CPU (no graphs) 8 tokens.
    warm = encode([{"role": "user", "content": prompts[0][0] if prompts and prompts[0] else "Hello"}])
    dev = tgt.device
    for g in gens.values():
        g.generate(warm, max_new_tokens if dev.type == "cuda" else 8, params, eos_ids=tok.eos_ids)
    for turns in tqdm(prompts, desc="bench", unit="prompt"):
        for spec, g in gens.items():
            r = results[spec]
            messages: list[dict] = []
            outs: list[int] = []
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                ids = encode(messages)
                _sync(dev)
                t0 = time.perf_counter()
                res = g.generate(ids, max_new_tokens, params, eos_ids=tok.eos_ids)
                _sync(dev)
                r.seconds += time.perf_counter() - t0
                r.new_tokens += res.stats.new_tokens
                r.steps += res.stats.steps
                r.accepted += sum(res.stats.accepted)
                r.drafted += res.stats.drafted
                r.prefill_s += res.stats.prefill_s
                r.draft_s += res.stats.draft_s
                r.verify_s += res.stats.verify_s
                outs.extend(res.token_ids)
                messages.append({"role": "assistant", "content": tok.decode([t for t in res.token_ids if t not in tok.eos_ids])})
            r.outputs.append(outs)
    base = results.get("none")
    rows = []
    for spec, r in results.items():
        if base is not None and spec != "none" and temperature == 0:
            r.mismatches = sum(a != b for a, b in zip(r.outputs, base.outputs))
        rows.append({
            "draft": spec, "new_tokens": r.new_tokens, "seconds": round(r.seconds, 3),
            "tokens_per_s": round(r.tokens_per_s, 2), "tau": round(r.tau, 3),
            "acceptance_rate": round(r.accepted / r.drafted, 4) if r.drafted else 0.0,
            "speedup_vs_none": round(r.tokens_per_s / base.tokens_per_s, 3) if base and base.tokens_per_s else None,
            "outputs_differing_from_none": r.mismatches if base is not None and temperature == 0 else None,
            "prefill_seconds": round(r.prefill_s, 3), "draft_seconds": round(r.draft_s, 3),
            "verify_seconds": round(r.verify_s, 3),
        })
    return {"machine": machine_description(dev), "commit": git_commit(), "model": model, "dataset": dataset,
            "num_prompts": len(prompts), "max_turns": max_turns, "max_new_tokens": max_new_tokens, "temperature": temperature,
            "dtype": str(tgt.dtype).replace("torch.", ""), "device": str(dev),
            "tensor_parallel": shard.world if shard else 1,
            # CUDA graphs exist on CUDA only: None (n/a) elsewhere. The fixed-row padding defaults to
            # on for CUDA and off for the CPU (see SpeculativeGenerator)
            "cuda_graphs": cuda_graphs and shard is None if dev.type == "cuda" else None,  # none under TP yet
            "batch_invariant": dev.type == "cuda" if batch_invariant is None else batch_invariant,
            "compile": compile, "rows": rows}


def machine_description(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
    gemm = "oneDNN" if cpu_linear.active() else "MKL"  # the fp32 linear layers' library (specdec/cpu_linear.py)
    return f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()}, torch {torch.__version__}, {gemm} linears"


def git_commit() -> str:
    """The commit the code was run from, ``+dirty`` when tracked files differ from it (a report of
    uncommitted code must not name a commit that does not hold it)."""
    if os.environ.get("SPECDEC_COMMIT"):  # set where the tree was copied without .git (device runs)
        return os.environ["SPECDEC_COMMIT"]
    return commit_of(os.path.dirname(os.path.abspath(__file__)))


def commit_of(path: str) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _flag(v) -> str:
    return "n/a" if v is None else str(v)


def format_table(report: dict) -> str:
    tp = f" | tensor_parallel {report['tensor_parallel']}" if report.get("tensor_parallel", 1) > 1 else ""
    head = (f"machine: {report['machine']} | commit {report['commit']} | {report['dataset']} x{report['num_prompts']}"
            f" | max_new_tokens {report['max_new_tokens']} | T={report['temperature']} | {report['dtype']} on {report['device']}"
            f" | cuda_graphs={_flag(report['cuda_graphs'])} batch_invariant={_flag(report['batch_invariant'])}"
            f" compile={report.get('compile', False)}{tp}\n")
    cols = ["draft", "tokens_per_s", "speedup_vs_none", "tau", "acceptance_rate", "new_tokens", "seconds", "outputs_differing_from_none"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in report["rows"]:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return head + "\n".join(lines)
