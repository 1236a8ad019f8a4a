"""The command line end to end on tiny checkpoints: generate (--json, --trace, --stop, drafters),
info (targets and DFlash drafters), bench, and errors that name the culprit with exit code 2."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _dflash_util import write_drafter  # noqa: E402
from _engine_util import build_llama  # noqa: E402

from specdec.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama"), vocab=64, hidden=32, layers=4)


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_json_trace_and_drafters_agree(llama_dir, capsys):
    # no tokenizer in this checkpoint: prompts are token ids through the API, so use generate via ids
    from specdec import LLM

    plain = LLM(llama_dir, device="cpu").generate([1, 2, 3, 4, 5, 1, 2, 3], max_new_tokens=24)
    for draft in ("ngram", f"dflash:{_dflash(llama_dir)}"):
        res = LLM(llama_dir, draft=draft, device="cpu").generate([1, 2, 3, 4, 5, 1, 2, 3], max_new_tokens=24,
                                                                  trace=True)
        assert res.token_ids == plain.token_ids, draft
        trace = res.stats.to_dict()["trace"]
        assert len(trace) == res.stats.steps and all(set(t) == {"draft", "accepted"} for t in trace)
        assert sum(t["accepted"] for t in trace) == sum(res.stats.accepted)


def _dflash(target_dir):
    d = os.path.join(target_dir, "..", "dflash")
    if not os.path.exists(d):
        write_drafter(d, hidden=32, num_target_layers=4, target_layer_ids=(1, 2), block_size=4)
    return os.path.abspath(d)


def test_info_target_and_drafter(llama_dir, capsys):
    rc, out, _ = _run(capsys, "info", llama_dir, "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["architecture"] == "llama" and d["layers"] == 4 and d["hidden_size"] == 32
    assert d["storage_types"] == {"F32": d["tensors"]}
    rc, out, _ = _run(capsys, "info", _dflash(llama_dir), "--json")
    d = json.loads(out)
    assert rc == 0 and d["block_size"] == 4 and d["target_layer_ids"] == [1, 2] and d["weight_bytes"] > 0


def test_generate_cli_on_embedded_model(capsys):
    pytest.importorskip("gguf")
    from specdec.api import default_model_path
    try:
        default_model_path()
    except Exception as e:  # the embedded model is installed by `make setup`
        pytest.skip(f"embedded model not installed: {e}")
    rc, out, _ = _run(capsys, "generate", "-p", "The capital of Germany is", "-n", "6", "--draft", "ngram",
                      "--json", "--trace")
    assert rc == 0
    d = json.loads(out)
    assert d["text"].startswith(" Berlin") and len(d["token_ids"]) == 6
    assert "trace" in d["stats"] and d["stats"]["new_tokens"] == 6
    rc, out, _ = _run(capsys, "generate", "-p", "The capital of Germany is", "-n", "30", "--stop", ".", "--json")
    d = json.loads(out)
    assert rc == 0 and d["text"] == " Berlin" and d["finish_reason"] == "stop"


def test_generate_hints_chat_when_a_bare_question_ends_at_once(capsys):
    """SmolLM2-Instruct ends a bare question (no chat template) at once: generate says why the reply is
    empty and that --chat gives one; with --chat, or when a --stop string ended it, it says nothing."""
    pytest.importorskip("gguf")
    from specdec.api import default_model_path
    try:
        default_model_path()
    except Exception as e:  # the embedded model is installed by `make setup`
        pytest.skip(f"embedded model not installed: {e}")
    q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
         "How many clips did Natalia sell altogether in April and May?")
    rc, _, err = _run(capsys, "generate", "-p", q, "-n", "8", "--draft", "none")
    assert rc == 0 and "add --chat" in err and "finish stop" in err
    rc, _, err = _run(capsys, "generate", "-p", q, "-n", "4", "--draft", "none", "--chat")
    assert rc == 0 and "add --chat" not in err
    rc, _, err = _run(capsys, "generate", "-p", "The capital of Germany is", "-n", "30", "--stop", ".", "--draft", "none")
    assert rc == 0 and "add --chat" not in err


@pytest.mark.parametrize("argv, culprit", [
    (["generate", "-m", "/nonexistent/model.gguf", "-p", "x"], "/nonexistent/model.gguf"),
    (["generate", "-p", "x", "--temperature", "-1"], "temperature"),
    (["generate", "-p", "x", "--top-p", "0"], "top_p"),
    (["generate", "-p", "x", "--draft", "eagle"], "eagle"),
    (["generate", "-p", "x", "--draft", "ngram", "--block-size", "4"], "--block-size"),
])
def test_cli_errors_name_the_culprit(argv, culprit, capsys):
    from specdec.api import default_model_path
    try:
        default_model_path()
    except Exception as e:
        pytest.skip(f"embedded model not installed: {e}")
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and culprit in err, err


def test_dflash_dir_as_target_is_refused(llama_dir, capsys):
    d = _dflash(llama_dir)
    rc, _, err = _run(capsys, "generate", "-m", d, "-p", "x")
    assert rc == 2 and "DFlash drafter checkpoint" in err and f"dflash:{d}" in err


def test_bench_reports_side_by_side(llama_dir, tmp_path, capsys):
    from specdec.bench import format_table, run_bench  # needs a tokenizer: use the embedded model when present
    from specdec.api import default_model_path
    try:
        model = default_model_path()
    except Exception as e:  # make test/.ci/run install it: a missing model is a setup error
        pytest.fail(f"embedded model not installed: {e}")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "Count from 1 to 20: 1, 2, 3,"}) + "\n")
    rep = run_bench(model, ["none", "ngram"], str(data), 1, 24, device="cpu", chat=False)
    rows = {r["draft"]: r for r in rep["rows"]}
    assert rows["none"]["new_tokens"] == rows["ngram"]["new_tokens"] == 24
    assert rows["ngram"]["outputs_differing_from_none"] == 0
    assert rows["ngram"]["tau"] > 1.0  # counting continues the prompt's pattern: n-gram drafts hit
    for r in rows.values():  # where the time went: parts of the timed generation, each really measured
        parts = r["prefill_seconds"] + r["draft_seconds"] + r["verify_seconds"]
        assert r["prefill_seconds"] > 0 and r["verify_seconds"] > 0 and parts <= r["seconds"] + 0.002, r
    assert rows["ngram"]["draft_seconds"] > 0
    # on the CPU there are no CUDA graphs and the fixed-row padding is off by default: the header says so
    assert rep["cuda_graphs"] is None and rep["batch_invariant"] is False and rep["compile"] is False
    assert "cuda_graphs=n/a batch_invariant=False" in format_table(rep)
    padded = run_bench(model, ["none"], str(data), 1, 8, device="cpu", chat=False, batch_invariant=True)
    assert padded["batch_invariant"] is True
