"""The command line's rough edges (issue 8): every bad argument ends in one ``error:`` line naming
the culprit, exit code 2 and no traceback, checked before any model is loaded; ``--version``;
``--help`` without torch; ``bench --draft``, its CPU header and its shipped prompt sets; the chat
loop's Ctrl-C and stop-string handling."""

import io
import json
import os
import subprocess
import sys

import pytest

from specdec import bench, cli
from specdec.chat import Streamer, chat_loop
from specdec.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING_MODEL = "/nonexistent/model.gguf"  # an argument error must be found before this is opened


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, culprit", [
    (["generate", "--prompt-file", "/nonexistent.txt"], "--prompt-file /nonexistent.txt: no such file"),
    (["generate", "-p", "x", "--device", "tpu"], "device 'tpu'"),
    (["generate", "-p", "x", "--temperature", "nan"], "temperature"),
    (["generate", "-p", "x", "--temperature", "inf"], "temperature"),
    (["generate", "-p", "x", "--top-p", "1.5"], "top_p"),
    (["generate", "-p", "x", "--top-k", "-3"], "top_k"),
    (["generate", "-p", "x", "--stop", ""], "stop strings must be non-empty"),
    (["generate", "-p", "x", "--stop", "ok", "--stop", ""], "stop strings must be non-empty"),
    (["generate", "-p", "x", "-n", "-5"], "-n/--max-new-tokens must be >= 1, got -5"),
    (["generate", "-p", "x", "-k", "-1", "--draft", "ngram"], "-k/--num-draft-tokens"),
    (["generate", "-p", "x", "-k", "0", "--draft", "mtp"], "-k/--num-draft-tokens 0 makes 'mtp' draft nothing"),
    (["bench", "-k", "0", "--drafts", "none", "dflash", "ngram"], "-k/--num-draft-tokens 0 makes 'ngram' draft nothing"),
    (["generate", "-p", "x", "--draft", "ngram", "--block-size", "4"], "-k/--num-draft-tokens"),
    (["generate", "-p", "x", "--block-size", "4"], "--block-size"),
    (["generate", "-p", "x", "--draft", "dflash:"], "draft 'dflash:' needs a path: dflash:PATH"),
    (["generate", "-p", "x", "--draft", "eagle"], "unknown drafter 'eagle'"),
    (["generate", "-p", "x", "--dtype", "int8"], "dtype 'int8'"),
    (["generate"], "no prompt: give PROMPT, --prompt"),
    (["chat", "--stop", ""], "stop strings must be non-empty"),
    (["chat", "--temperature", "nan"], "temperature"),
    (["bench", "--draft", "eagle"], "unknown drafter 'eagle'"),
    (["bench", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "--data-dir", "/nonexistent-bench-data"], "/nonexistent-bench-data: no such directory"),
    (["generate", "-p", "x", "--draft", "mtp", "--draft-int8"], "--draft-int8 applies to DFlash drafters"),
    (["generate", "-p", "x", "--draft", "dflash", "--draft-int8", "--compile"], "--draft-int8: the int8 DFlash drafter "
     "runs on its fast CUDA steps, not with --compile"),
    (["bench", "--drafts", "none", "ngram", "--draft-int8"], "--draft-int8 applies to DFlash drafters"),
])
def test_bad_arguments_fail_before_loading(argv, culprit, capsys):
    """One line ``specdec CMD: error: ...`` naming the culprit, exit code 2, and never the missing
    model's name: the argument is refused before the model would be opened."""
    rc, out, err = _run(capsys, *argv[:1], "-m", MISSING_MODEL, *argv[1:])
    assert rc == 2, err
    assert err.startswith(f"specdec {argv[0]}: error: ") and err.count("\n") == 1, err
    assert culprit in err and MISSING_MODEL not in err, err


def test_prompt_as_positional_argument(capsys):
    """``specdec generate 'TEXT'`` takes TEXT as the prompt (as ``-p``, before any model is opened); with ``-p``
    too, argparse refuses the pair."""
    from types import SimpleNamespace
    args = cli.build_parser().parse_args(["generate", "What is 2 + 2?"])
    assert cli._read_prompt(args) == "What is 2 + 2?"
    assert cli._read_prompt(SimpleNamespace(prompt="a", text=None, prompt_file=None)) == "a"
    with pytest.raises(SystemExit) as e:
        main(["generate", "-m", MISSING_MODEL, "x", "-p", "y"])
    assert e.value.code == 2 and "not allowed with argument PROMPT" in capsys.readouterr().err


def test_info_on_a_missing_path(capsys):
    rc, _, err = _run(capsys, "info", "/nonexistent/model.gguf")
    assert rc == 2 and err == "specdec info: error: /nonexistent/model.gguf: no such file or directory\n"


def test_prompt_file_that_is_a_directory(tmp_path, capsys):
    rc, _, err = _run(capsys, "generate", "-m", MISSING_MODEL, "--prompt-file", str(tmp_path))
    assert rc == 2 and f"--prompt-file {tmp_path}: is a directory" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out, _ = capsys.readouterr()
    from specdec import __version__
    assert e.value.code == 0 and out.strip() == f"specdec {__version__}"


def test_help_does_not_import_torch():
    """``specdec --help`` and ``specdec generate --help`` must not pay for importing torch."""
    code = ("import sys, contextlib, io\n"
            "import specdec.cli as cli\n"
            "for argv in (['--help'], ['generate', '--help'], ['bench', '--help'], ['--version']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            cli.main(argv)\n"
            "        except SystemExit as e:\n"
            "            assert e.code == 0, (argv, e.code)\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'tokenizers', 'gguf') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "from specdec import LLM, load_target, SamplingParams\n"
            "assert 'torch' in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr


def test_keyboard_interrupt_exits_130_with_a_newline(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    rc, _, err = _run(capsys, "info")
    assert rc == 130 and err == "\n"


# --- bench -----------------------------------------------------------------------------------------

def test_bench_draft_is_an_alias_that_adds_to_drafts():
    args = cli.build_parser().parse_args(["bench", "--draft", "ngram", "--draft", "dflash:/d"])
    assert cli.bench_drafts(args.drafts, args.draft_extra) == ["none", "ngram", "dflash:/d"]
    args = cli.build_parser().parse_args(["bench", "--drafts", "ngram", "--draft", "mtp"])
    assert cli.bench_drafts(args.drafts, args.draft_extra) == ["none", "ngram", "mtp"]
    args = cli.build_parser().parse_args(["bench"])
    assert cli.bench_drafts(args.drafts, args.draft_extra) == ["none", "ngram"]
    assert cli.bench_drafts(["ngram", "none"], ["ngram"]) == ["ngram", "none"]


def test_bench_header_says_what_applies_on_the_device():
    report = {"machine": "m", "commit": "c", "dataset": "d", "num_prompts": 1, "max_new_tokens": 8,
              "temperature": 0.0, "dtype": "float32", "device": "cpu", "cuda_graphs": None,
              "batch_invariant": False, "rows": []}
    assert "cuda_graphs=n/a batch_invariant=False" in bench.format_table(report)
    report.update(device="cuda:0", cuda_graphs=True, batch_invariant=False)
    assert "cuda_graphs=True batch_invariant=False compile=False" in bench.format_table(report)
    report.update(compile=True)
    assert "cuda_graphs=True batch_invariant=False compile=True" in bench.format_table(report)


def test_compile_flag_reaches_the_engine(monkeypatch):
    """--compile (generate, chat, bench) is off by default and is passed to the LLM the CLI builds."""
    import specdec.api

    p = cli.build_parser()
    for cmd in (["generate", "-p", "x"], ["bench"], ["chat"]):
        assert p.parse_args(cmd).compile is False and p.parse_args(cmd + ["--compile"]).compile is True
    seen = {}
    monkeypatch.setattr(specdec.api, "LLM", lambda *a, **kw: seen.update(kw))
    cli._make_llm(p.parse_args(["generate", "-p", "x", "--compile"]))
    assert seen["compile"] is True


def test_bench_prompt_sets_ship_with_the_package(monkeypatch):
    monkeypatch.delenv("SPECDEC_BENCH_DATA", raising=False)
    assert bench.find_data_dir() == bench.PACKAGED_DATA
    for name, n in (("gsm8k", 3), ("humaneval", 2), ("mt_bench", 2)):
        prompts = bench.load_prompts(name, n)
        assert len(prompts) == n and all(t and all(isinstance(s, str) and s for s in t) for t in prompts)
    assert "Janet" in bench.load_prompts("gsm8k", 1)[0][0]  # the first gsm8k test question


def test_bench_package_data_is_declared():
    """Every shipped prompt file matches the package-data globs of pyproject.toml, so a
    non-editable install (a wheel) carries it too."""
    import fnmatch
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        globs = tomllib.load(fh)["tool"]["setuptools"]["package-data"]["specdec.data.bench"]
    files = sorted(os.listdir(bench.PACKAGED_DATA))
    assert {"gsm8k_test.jsonl", "gsm8k_train.jsonl", "humaneval.jsonl", "mt_bench.jsonl", "README.md"} <= set(files)
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
    assert sum(os.path.getsize(os.path.join(bench.PACKAGED_DATA, f)) for f in files) < 6_000_000


def test_bench_data_overrides(tmp_path, monkeypatch):
    (tmp_path / "gsm8k_test.jsonl").write_text(json.dumps({"question": "What is 2 + 2?"}) + "\n")
    monkeypatch.setenv("SPECDEC_BENCH_DATA", str(tmp_path))
    assert bench.load_prompts("gsm8k", 5)[0][0].startswith("What is 2 + 2?")
    other = tmp_path / "other"
    other.mkdir()
    (other / "gsm8k_test.jsonl").write_text("\n" + json.dumps({"question": "Q?"}) + "\n{oops\n")
    assert bench.load_prompts("gsm8k", 1, data_dir=str(other))[0][0].startswith("Q?")  # --data-dir wins
    with pytest.raises(bench.ConfigError, match=r"gsm8k_test.jsonl:3: not valid JSON"):
        bench.load_prompts("gsm8k", 5, data_dir=str(other))
    with pytest.raises(bench.ConfigError, match=r"humaneval.jsonl: no such file"):
        bench.load_prompts("humaneval", 1, data_dir=str(other))
    monkeypatch.setenv("SPECDEC_BENCH_DATA", str(tmp_path / "gone"))
    with pytest.raises(bench.ConfigError, match=r"gone: no such directory .*SPECDEC_BENCH_DATA"):
        bench.load_prompts("gsm8k", 1)


# --- streaming and the chat loop -------------------------------------------------------------------

class _CharTokenizer:
    """One character per token id (id = code point); id 0 is EOS."""
    eos_ids = [0]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class _Result:
    def __init__(self, text, n):
        from specdec.engine import Stats
        self.text, self.stats = text, Stats(new_tokens=n, total_s=1.0)


class _FakeLLM:
    """Streams ``replies`` one by one as the engine would (cut before a stop string); a reply
    ``None`` streams a few tokens and then raises KeyboardInterrupt, as Ctrl-C does."""

    def __init__(self, replies):
        self.tokenizer, self.replies, self.calls = _CharTokenizer(), list(replies), []

    def generate(self, messages, on_tokens=None, stop=None, **kw):
        self.calls.append([dict(m) for m in messages])
        reply = self.replies.pop(0)
        if reply is None:
            on_tokens([ord(c) for c in "half a rep"])
            raise KeyboardInterrupt
        ids = [ord(c) for c in reply] + [0]
        for i in range(0, len(ids), 3):  # three tokens per step
            on_tokens(ids[i:i + 3])
        cuts = [reply.find(s) for s in stop or () if s in reply]
        return _Result(reply[:min(cuts)] if cuts else reply, len(ids))


def _chat(llm, lines, **gen):
    it = iter(lines)

    def read(prompt):
        v = next(it)
        if isinstance(v, BaseException):
            raise v
        return v

    out, err = io.StringIO(), io.StringIO()
    try:
        rc = chat_loop(llm, gen, read=read, out=out, err=err)
    except KeyboardInterrupt:  # would end the test run, not just this test
        pytest.fail("KeyboardInterrupt escaped the chat loop")
    return rc, out.getvalue(), err.getvalue()


def test_chat_ctrl_c_stops_the_reply_not_the_chat():
    llm = _FakeLLM([None, "Fine, thanks."])
    rc, out, err = _chat(llm, ["hi", "how are you?", ""])
    assert rc == 0
    assert out == "half a rep\nFine, thanks.\n"  # the stopped reply ends its line
    assert "[reply stopped]" in err
    assert [m["content"] for m in llm.calls[1]] == ["how are you?"]  # the unanswered turn was dropped


def test_chat_ctrl_c_or_eof_at_the_prompt_quits_cleanly():
    rc, out, _ = _chat(_FakeLLM(["Hello."]), ["hi", KeyboardInterrupt()])
    assert rc == 130 and out == "Hello.\n\n"
    rc, out, _ = _chat(_FakeLLM([]), [EOFError()])
    assert rc == 0 and out == "\n"


def test_chat_with_stop_prints_the_reply_once():
    llm = _FakeLLM(["Berlin. And more text.", "Paris."])
    rc, out, _ = _chat(llm, ["capital?", "and France?", ""], stop=[". A"])
    assert rc == 0 and out == "Berlin\nParis.\n"
    assert llm.calls[1][1] == {"role": "assistant", "content": "Berlin"}


def test_streamer_holds_back_what_may_be_a_stop_string():
    out = io.StringIO()
    s = Streamer(_CharTokenizer(), ["\n\n", "STOP"], out)
    for chunk in ("Hel", "lo S", "TO", "P and"):
        s([ord(c) for c in chunk])
        assert "S" not in out.getvalue()  # never a byte of a (possible) stop string
    s.finish("Hello ")
    assert out.getvalue() == "Hello "
    out = io.StringIO()
    s = Streamer(_CharTokenizer(), None, out)
    s([ord(c) for c in "abc"] + [0])
    s.finish("abc")
    assert out.getvalue() == "abc"


def test_batch_invariant_flag_is_tri_state():
    """Unset: the engine's default (on for CUDA, off for the CPU); --batch-invariant forces the
    padded static steps (also on the CPU); --no-batch-invariant turns them off."""
    p = cli.build_parser()
    for argv, want in (([], None), (["--batch-invariant"], True), (["--no-batch-invariant"], False)):
        for cmd in (["generate", "-p", "x"], ["bench"], ["chat"]):
            assert p.parse_args(cmd + argv).batch_invariant is want, (cmd, argv)


def test_report_commit_says_dirty(tmp_path):
    """A benchmark report names its commit, with ``+dirty`` when tracked files differ from it."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert bench.commit_of(str(tmp_path)) == head
    (tmp_path / "new.py").write_text("untracked\n")  # untracked files do not make it dirty
    assert bench.commit_of(str(tmp_path)) == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert bench.commit_of(str(tmp_path)) == head + "+dirty"
    import tempfile
    with tempfile.TemporaryDirectory() as plain:  # no repository: said so
        assert bench.commit_of(plain) == "unknown"


def test_bench_prompt_files_of_each_format(tmp_path):
    """A .jsonl prompt file: records with 'turns', 'prompt', or 'question' (a GSM8K-format file such as
    gsm8k_train.jsonl gets GSM8K's prompt); anything else is one line naming the file, line and field."""
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in (
        {"turns": ["a", "b"]}, {"prompt": "c"}, {"question": "What is 2 + 2?", "answer": "4"})) + "\n")
    got = bench.load_prompts(str(f), 5)
    assert got[:2] == [["a", "b"], ["c"]]
    assert got[2] == bench.load_prompts("gsm8k", 1, data_dir=_gsm8k_dir(tmp_path, "What is 2 + 2?"))[0]
    for bad, msg in (({"turns": "a"}, "'turns' must be a non-empty list of strings"), ({"prompt": 3}, "'prompt' must be a string"),
                     ({"text": "x"}, "record without 'turns', 'prompt' or 'question'")):
        f.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(bench.ConfigError, match=f"p.jsonl:2: {msg}"):
            bench.load_prompts(str(f), 5)


def _gsm8k_dir(tmp_path, question):
    d = tmp_path / "g"
    d.mkdir(exist_ok=True)
    (d / "gsm8k_test.jsonl").write_text(json.dumps({"question": question}) + "\n")
    return str(d)
