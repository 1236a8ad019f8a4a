"""scripts/ab_lookahead.py and scripts/ab_prefill.py (GPU A/B scripts): on the CPU with a tiny shape
they run end to end and report what they promise (tokens identical, a time per variant and length);
bad input fails in one line."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import ab_lookahead  # noqa: E402
import ab_prefill  # noqa: E402
import ab_sampled  # noqa: E402


def test_lookahead_script_runs(tmp_path, single_thread):
    out = tmp_path / "la.json"
    assert ab_lookahead.main(["--shape", "tiny", "--prompts", "2", "--prompt-len", "12", "-n", "6", "--device", "cpu",
                              "--chain", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["outputs_differing"] == 0 and r["prompts"] == 2 and r["off_tokens_per_s"] > 0 and r["on_tokens_per_s"] > 0
    assert r["chain_outputs_differing"] == 0 and r["chain_tokens_per_s"] > 0


def test_prefill_script_runs(tmp_path, single_thread):
    out = tmp_path / "p.json"
    assert ab_prefill.main(["--shape", "tiny", "--lengths", "5", "40", "--reps", "1", "--device", "cpu",
                            "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["prompt_tokens"] for x in r["rows"]] == [5, 40] and r["wide_rows"] == 128
    assert all(x[f"{v}_ms"] > 0 for x in r["rows"] for v in ("eager", "narrow", "wide"))


def test_sampled_script_runs(tmp_path, single_thread):
    """scripts/ab_sampled.py on the CPU: every variant of every drafter runs, and the variants that draw alike
    (accept vs eager, accept+scan vs eager+scan) give the same outputs (its differ column: 0)."""
    out = tmp_path / "s.json"
    assert ab_sampled.main(["--shape", "tiny", "--device", "cpu", "--num-prompts", "2", "-n", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["drafter"], r["variant"]) for r in rows} >= {("none", "accept+scan"), ("dflash", "both+scan"), ("mtp", "accept")}
    differ = {(r["drafter"], r["variant"]): r["differ"] for r in rows if r["differ"] is not None}
    assert len(differ) == 8 and set(differ.values()) == {0}, differ
    assert all(r["tok_s"] > 0 and r["tau"] >= 1 for r in rows)


@pytest.mark.parametrize("main, argv, msg", [
    (ab_lookahead.main, ["--shape", "tiny", "--prompts", "0"], "must be >= 1"),
    (ab_lookahead.main, ["--shape", "no-such"], "no-such"),
    (ab_lookahead.main, ["--model", "/no/such/file.gguf"], "/no/such/file.gguf"),
    (ab_prefill.main, ["--shape", "tiny", "--rows", "8"], "--rows > 16"),
    (ab_prefill.main, ["--shape", "tiny", "--lengths", "99999", "--device", "cpu"], "exceeds the model's context"),
    (ab_prefill.main, ["--shape", "no-such"], "no-such")])
def test_bad_input_is_one_line(main, argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and "Traceback" not in err[0]


def test_span_added_counts_what_each_kernel_adds():
    """profile_shape_step.span_added: under PDL a kernel starts early and waits; it adds only how far its end passes
    the latest end before it (an idle gap before a kernel counts as its own), so the adds sum to the span."""
    import profile_shape_step
    spans = [(0.0, 10.0, "gemm"), (2.0, 14.0, "norm"), (3.0, 12.0, "early"), (20.0, 25.0, "gemm")]
    added = dict(profile_shape_step.span_added(spans))
    assert added == {"gemm": (2, pytest.approx(21e-3)), "norm": (1, pytest.approx(4e-3)), "early": (1, 0.0)}
    assert sum(ms for _, ms in added.values()) == pytest.approx(25e-3)
    assert profile_shape_step.ordered(spans) == [("gemm", 0.0, 10.0, 10.0), ("norm", 2.0, 12.0, 4.0),
                                                 ("early", 3.0, 9.0, 0.0), ("gemm", 20.0, 5.0, 11.0)]
