"""The Python API's rough edges (issue 8): the README's example runs as written, ``load_target(None)``
is the embedded default like ``LLM(None)``, empty stop strings are refused, and the end-of-turn
ids of ``generation_config.json`` stop generation."""

import contextlib
import io
import json
import os
import re
import shutil
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _engine_util import build_llama  # noqa: E402

from specdec import api  # noqa: E402
from specdec.api import LLM  # noqa: E402
from specdec.errors import ConfigError, RequestError  # noqa: E402
from specdec.loading import load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [1, 5, 9, 3, 7]

pytestmark = pytest.mark.usefixtures("single_thread")


def _embedded_model() -> str:
    try:
        return api.default_model_path()
    except Exception as e:  # installed by `make setup`
        pytest.skip(f"embedded model not installed: {e}")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama") / "m", vocab=48, hidden=32, layers=2)


def test_readme_python_example_runs_verbatim():
    _embedded_model()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        section = fh.read().split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "README.md's Python section: the LLM example, then the serving loop's"
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:  # in order, in one scope, as a reader would paste them
            exec(compile(block, "README.md", "exec"), scope)
    assert out.getvalue().rstrip().splitlines()[-1].startswith("done ")  # the serving loop's last event
    assert scope["res"].text.startswith(" Berlin") and out.getvalue().startswith(" Berlin")
    assert tuple(scope["logits"].shape) == (3, scope["llm"].model.config.vocab_size)


def test_load_target_none_is_the_embedded_default(monkeypatch):
    loaded = []
    monkeypatch.setattr(api, "default_model_path", lambda: "/embedded/default.gguf")
    monkeypatch.setattr(api, "load_model", lambda path, device, dtype, **kw: loaded.append((path, device)) or
                        SimpleNamespace(model=None, tokenizer=None))
    api.load_target(None, device="cpu")
    api.load_target(device="cpu")
    api.load_target("other.gguf", device="cpu")
    assert loaded == [("/embedded/default.gguf", "cpu")] * 2 + [("other.gguf", "cpu")]


@pytest.mark.parametrize("stop", ["", ["ok", ""], [None]])
def test_empty_stop_string_is_refused(llama_dir, stop):
    llm = LLM(llama_dir, device="cpu")
    with pytest.raises(RequestError, match="stop strings must be non-empty"):
        llm.generate(PROMPT, max_new_tokens=4, stop=stop)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


def _write_generation_config(path: str, **fields) -> None:
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as fh:
        json.dump(fields, fh)


def _write_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer.json (token i is the word 'w{i}'), enough for load_model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "int"])
def test_generation_config_eos_ids_stop_generation(llama_dir, tmp_path, as_list):
    """An instruct checkpoint whose end-of-turn id is named only in generation_config.json stops there."""
    plain = LLM(llama_dir, device="cpu").generate(PROMPT, max_new_tokens=12)
    assert plain.finish_reason == "length"
    eot = plain.token_ids[4]  # pretend the 5th generated token is the end-of-turn token
    end = plain.token_ids.index(eot) + 1
    path = _copy(llama_dir, tmp_path / "instruct")
    _write_generation_config(path, eos_token_id=[eot] if as_list else eot)
    res = LLM(path, device="cpu").generate(PROMPT, max_new_tokens=12)
    assert res.token_ids == plain.token_ids[:end] and res.finish_reason == "stop"
    _write_tokenizer(path, 48)  # the tokenizer's stop ids include it as well
    assert eot in load_model(path, "cpu").tokenizer.eos_ids


@pytest.mark.parametrize("content, match", [
    ('{"eos_token_id": "<|im_end|>"}', "'eos_token_id' must be a token id or a list of token ids"),
    ('{"eos_token_id": [2, -1]}', "'eos_token_id'"),
    ('{"eos_token_id": [true]}', "'eos_token_id'"),
    ('{"eos_token_id": 2,', "not valid JSON"),
])
def test_malformed_generation_config_names_file_and_field(llama_dir, tmp_path, content, match):
    path = _copy(llama_dir, tmp_path / "bad")
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as fh:
        fh.write(content)
    with pytest.raises(ConfigError, match=match) as e:
        load_model(path, "cpu")
    assert os.path.join(path, "generation_config.json") in str(e.value)
