"""The shipped training prompts (specdec/data/train/): they parse, have the counts their README
states, hold no duplicates, share no question with the test sets, and the templated three are what
scripts/make_train_prompts.py writes, byte for byte, as the maths set is what scripts/make_math_prompts.py
writes (the self-instruct set was sampled on a GPU by scripts/make_self_instruct.py: its provenance is in the README, not reproducible here). The test sets
are read here only to prove that the training prompts are disjoint from them."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "specdec", "data", "train")
BENCH = os.path.join(ROOT, "specdec", "data", "bench")
TEMPLATED = ("chat_prompts.jsonl", "code_prompts.jsonl", "function_prompts.jsonl")
FILES = TEMPLATED + ("self_instruct_prompts.jsonl", "math_prompts.jsonl")


def _prompts(name: str) -> list[str]:
    out = []
    with open(os.path.join(TRAIN, name), encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            r = json.loads(line)
            field = "question" if name == "math_prompts.jsonl" else "prompt"  # maths: asked as GSM8K is
            assert list(r) == [field] and isinstance(r[field], str) and r[field].strip(), f"{name}:{lineno}"
            out.append(r[field])
    return out


def _readme_counts() -> dict[str, int]:
    with open(os.path.join(TRAIN, "README.md"), encoding="utf-8") as fh:
        return {m[0]: int(m[1]) for m in re.findall(r"^\| (\w+\.jsonl) \| (\d+) \|", fh.read(), re.M)}


def _test_set_texts() -> list[str]:
    """Every question, prompt and turn of the three test sets (not gsm8k_train: that one is for training)."""
    texts = []
    for name, get in (("gsm8k_test.jsonl", lambda r: [r["question"]]), ("humaneval.jsonl", lambda r: [r["prompt"]]),
                      ("mt_bench.jsonl", lambda r: r["turns"])):
        with open(os.path.join(BENCH, name), encoding="utf-8") as fh:
            texts += [t.strip() for line in fh if line.strip() for t in get(json.loads(line))]
    assert len(texts) > 1500
    return texts


def test_files_parse_and_match_the_readme_counts():
    counts = _readme_counts()
    assert sorted(counts) == sorted(FILES)
    for name in FILES:
        assert len(_prompts(name)) == counts[name], name


def test_no_duplicates_within_or_across_files():
    allp = [p for name in FILES for p in _prompts(name)]
    assert len(set(allp)) == len(allp)
    assert len({" ".join(p.lower().split()) for p in allp}) == len(allp)  # not even up to case and spacing


def test_disjoint_from_the_test_sets():
    """No training prompt equals or contains a test-set text, and none is contained in one either."""
    allp = [p for name in FILES for p in _prompts(name)]
    joined = "\0".join(allp)
    tests = _test_set_texts()
    assert [t for t in tests if t in joined] == []
    joined_tests = "\0".join(tests)
    # a prompt inside a test text has its first 16 characters there too: search only those that do
    grams = {joined_tests[i:i + 16] for i in range(len(joined_tests) - 15)}
    maybe = [p.strip() for p in allp if len(p.strip()) < 16 or p.strip()[:16] in grams]
    assert [p for p in maybe if p in joined_tests] == []


def test_script_reproduces_the_files(tmp_path):
    script = os.path.join(ROOT, "scripts", "make_train_prompts.py")
    subprocess.run([sys.executable, script, "--out", str(tmp_path)], check=True, capture_output=True, timeout=60)
    for name in TEMPLATED:
        with open(os.path.join(TRAIN, name), "rb") as a, open(tmp_path / name, "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the script's output: rerun scripts/make_train_prompts.py"


def test_math_script_reproduces_its_file(tmp_path):
    script = os.path.join(ROOT, "scripts", "make_math_prompts.py")
    subprocess.run([sys.executable, script, "--out", str(tmp_path)], check=True, capture_output=True, timeout=60)
    with open(os.path.join(TRAIN, "math_prompts.jsonl"), "rb") as a, open(tmp_path / "math_prompts.jsonl", "rb") as b:
        assert a.read() == b.read(), "math_prompts.jsonl differs from the script's output: rerun scripts/make_math_prompts.py"


def test_math_questions_are_asked_as_gsm8k_is():
    from specdec.train.data import GSM8K_SUFFIX, read_prompts

    got = read_prompts("math")
    assert len(got) == _readme_counts()["math_prompts.jsonl"] and all(p.endswith(GSM8K_SUFFIX) for p in got)


def test_package_data_is_declared():
    """Every file in specdec/data/train matches its package-data globs, so a wheel carries it too."""
    import fnmatch
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        globs = tomllib.load(fh)["tool"]["setuptools"]["package-data"]["specdec.data.train"]
    files = sorted(os.listdir(TRAIN))
    assert set(FILES) | {"README.md"} <= set(files)
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
