"""Plain decoding end to end, the lookahead off and on (``SpeculativeGenerator(lookahead=...)``), in one
process with the two interleaved per prompt, as `specdec bench` interleaves drafters (separate
processes drift by a few percent on the H200). Real weights on bench prompts (chat template), or a
random target of a published shape on random prompts. Prints tok/s of each and whether the tokens
are identical. The lookahead needs static steps (CUDA's default); on the CPU both runs are the plain loop.
``--chain`` adds a third variant, the lookahead on the greedy-chain steps (``SPECDEC_GREEDY_CHAIN``).

    PYTHONPATH=. python scripts/ab_lookahead.py --model M.gguf --dataset gsm8k --prompts 40 -n 128
    PYTHONPATH=. python scripts/ab_lookahead.py --shape qwen3-8b --prompts 4 -n 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def load_target(model: str | None, shape: str | None, device: str | None):
    """(target, tokenizer or None): real weights from ``model``, else a random target of ``shape``
    built in device memory. Raises SpecdecError on a bad path or shape."""
    if model:
        from specdec.loading import load_model
        loaded = load_model(model, device)
        return loaded.model, loaded.tokenizer
    from specdec.bench_shape import build_shape
    from specdec.loading import resolve_device, resolve_dtype
    dev = resolve_device(device)
    return build_shape(shape, dev, resolve_dtype(None, dev)), None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF directory or GGUF file")
    src.add_argument("--shape", help="a published shape (specdec bench --shape names them)")
    ap.add_argument("--dataset", default="gsm8k", help="bench prompt set for --model (default gsm8k)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (default 8)")
    ap.add_argument("--prompt-len", type=int, default=128, help="random prompt length for --shape (default 128)")
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--chain", action="store_true",
                    help="also a third variant, 'chain': the lookahead on the greedy-chain steps (SPECDEC_GREEDY_CHAIN)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.new_tokens < 1 or a.prompt_len < 1:
        print("error: --prompts, -n and --prompt-len must be >= 1", file=sys.stderr)
        return 2

    from specdec.bench import _sync, load_prompts, machine_description
    from specdec.engine import SpeculativeGenerator
    from specdec.errors import SpecdecError

    try:
        model, tok = load_target(a.model, a.shape, a.device)
        if tok is not None:
            eos = tok.eos_ids
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t[0]}]), add_special=False)
                       for t in load_prompts(a.dataset, a.prompts)]
        else:
            g = torch.Generator().manual_seed(0)
            eos = ()
            prompts = [torch.randint(0, model.config.vocab_size, (a.prompt_len,), generator=g).tolist()
                       for _ in range(a.prompts)]
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = model.device
    from specdec.engine import generate as engine_mod
    gens = {"off": SpeculativeGenerator(model, lookahead=False), "on": SpeculativeGenerator(model, lookahead=True)}
    if a.chain:
        gens["chain"] = SpeculativeGenerator(model, lookahead=True)
    chain_default = engine_mod.GREEDY_CHAIN

    def generate(v, *args, **kw):
        engine_mod.GREEDY_CHAIN = v == "chain"  # "on" is the lookahead on the plain steps
        try:
            return gens[v].generate(*args, **kw)
        finally:
            engine_mod.GREEDY_CHAIN = chain_default
    secs = {v: 0.0 for v in gens}
    toks = {v: 0 for v in gens}
    outs = {v: [] for v in gens}
    for v in gens:
        generate(v, prompts[0][:8], 8, eos_ids=eos)  # warm-up: capture, allocator
    order = list(gens)
    for i, p in enumerate(prompts):
        for v in (order if i % 2 == 0 else order[::-1]):
            _sync(dev)
            t0 = time.perf_counter()
            r = generate(v, p, a.new_tokens, eos_ids=eos)
            _sync(dev)
            secs[v] += time.perf_counter() - t0
            toks[v] += len(r.token_ids)
            outs[v].append(r.token_ids)
    rep = {"machine": machine_description(dev), "source": a.model or a.shape, "prompts": len(prompts),
           "new_tokens": a.new_tokens,
           **{f"{v}_tokens_per_s": round(toks[v] / secs[v], 2) for v in gens},
           "speedup": round((toks["on"] / secs["on"]) / (toks["off"] / secs["off"]), 4),
           "outputs_differing": sum(x != y for x, y in zip(outs["off"], outs["on"]))}
    if a.chain:
        rep["chain_speedup_over_on"] = round((toks["chain"] / secs["chain"]) / (toks["on"] / secs["on"]), 4)
        rep["chain_outputs_differing"] = sum(x != y for x, y in zip(outs["off"], outs["chain"]))
    print(json.dumps(rep))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
