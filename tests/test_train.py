"""``specdec train`` end to end on a tiny target (CPU): the loss falls, the written drafter loads
and drafts losslessly, an interrupted run resumes from its checkpoint, replies are cached."""

import json
import os

import pytest
import torch

from _dense_util import tiny_model, write_gguf
from specdec.api import LLM, Target
from specdec.cli import main
from specdec.train.trainer import TrainConfig, lr_at

MASK = 300  # a padding token of the tiny vocabulary (no special tokens to pick from)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tgt") / "tiny.gguf")
    write_gguf(tiny_model("llama", seed=4), path)
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "prompts.txt"
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "paper", "green"]
    lines = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (6,), generator=g)) for _ in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _train(capsys, target, prompts, out, cache, kind, *extra, arch=True):
    argv = ["train", kind, "--target", target, "--prompts", prompts, "--no-chat", "--out", out, "--device", "cpu",
            "--max-new-tokens", "24", "--batch-tokens", "640", "--eval-prompts", "2", "--eval-tokens", "12",
            "--data-cache", cache, "--lr", "3e-3", "--warmup", "0.1"]
    argv += (["--anchors", "8"] + (["--layers", "1", "--block-size", "4", "--mask-token-id", str(MASK)] if arch else [])
             if kind == "dflash" else ["--steps", "2"])
    rc = main(argv + list(extra))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _lossless(target, spec, prompts):
    spec_llm, plain = LLM(target, draft=spec, device="cpu"), LLM(target, device="cpu")
    accepted = 0
    for p in open(prompts).read().splitlines()[:3]:
        a = spec_llm.generate(p, max_new_tokens=20)
        b = plain.generate(p, max_new_tokens=20)
        assert a.token_ids == b.token_ids
        accepted += sum(a.stats.accepted)
    assert accepted > 0  # the trained drafter's drafts were accepted: verify and rollback really ran


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_train_lowers_loss_and_writes_a_lossless_drafter(kind, target, prompts, tmp_path, capsys):
    out = str(tmp_path / kind)
    rc, stdout, err = _train(capsys, target, prompts, out, str(tmp_path / "cache"), kind, "--epochs", "8",
                             "--draft-vocab-size", "40")
    assert rc == 0, err
    vocab = json.load(open(os.path.join(out, "draft_vocab.json")))["token_ids"]  # the replies' 40 commonest tokens
    assert len(vocab) == 40 and vocab == sorted(set(vocab))
    llm = LLM(target, draft=f"{kind}:{out}", device="cpu")  # used by default; --draft-vocab none: the whole head
    assert len(llm.drafter.vocab) == 40
    assert LLM(target, draft=f"{kind}:{out}", device="cpu", draft_vocab="none").drafter.vocab is None
    info = json.load(open(os.path.join(out, "training.json")))
    assert info["last_epoch_loss"] < 0.8 * info["first_epoch_loss"], info
    assert info["command"].startswith(f"specdec train {kind} --target ")
    assert "held-out tau" in err and os.path.exists(os.path.join(out, "TRAINING.md"))
    assert not os.path.exists(out + ".ckpt.pt")  # removed once the drafter is written
    _lossless(target, f"{kind}:{out}", prompts)


def test_interrupted_run_resumes_from_its_step(target, prompts, tmp_path, capsys):
    out, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    rc, _, err = _train(capsys, target, prompts, out, cache, "dflash", "--epochs", "2", "--time-limit", "1e-6")
    assert rc == 3 and "stopped by the time limit at step 1/" in err, err
    assert os.path.exists(out + ".ckpt.pt") and not os.path.exists(out)
    saved = torch.load(out + ".ckpt.pt", weights_only=False)["step"]
    rc, _, err = _train(capsys, target, prompts, out, cache, "dflash", "--epochs", "2")
    assert rc == 0, err
    assert f"resuming from {out}.ckpt.pt at step {saved}/" in err
    assert "distilling" not in err  # the replies came from the cache
    assert os.path.isdir(out) and not os.path.exists(out + ".ckpt.pt")
    # a different recipe refuses the checkpoint of this one
    rc, _, err = _train(capsys, target, prompts, out, cache, "dflash", "--epochs", "2", "--time-limit", "1e-6")
    assert rc == 3
    rc, _, err = _train(capsys, target, prompts, out, cache, "dflash", "--epochs", "3")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("specdec train: error: ") and "checkpoint of a different run" in last


def test_minutes_end_the_run_by_the_clock_and_write_the_drafter(target, prompts, tmp_path, capsys):
    out = str(tmp_path / "m")
    # 6 seconds run out long before 500 epochs of this data end (~2 steps and an evaluation each)
    rc, _, err = _train(capsys, target, prompts, out, str(tmp_path / "cache"), "mtp", "--epochs", "500",
                        "--minutes", "0.1")
    assert rc == 0, err
    info = json.load(open(os.path.join(out, "training.json")))
    assert 1 <= info["steps"] < 500 * info["batches_per_epoch"], info
    # the bar counts the steps the clock allows, not 500 epochs': it ends full
    n = info["steps"]
    assert f"{n}/{n} [" in err.replace("\r", "\n"), err[-600:]
    assert len(info["held_out_tau"]) >= 1 and not os.path.exists(out + ".ckpt.pt")
    _lossless(target, f"mtp:{out}", prompts)


def test_the_schedule_on_the_clock():
    cfg = TrainConfig(lr=1.0, warmup=0.1, minutes=10.0)
    assert lr_at(0, 1000, cfg, 30.0) == pytest.approx(0.5)  # 5 % of the time: half-way up the warm-up
    assert lr_at(0, 1000, cfg, 60.0) == pytest.approx(1.0)
    assert lr_at(0, 1000, cfg, 330.0) == pytest.approx(0.5)  # half-way through the decay
    assert lr_at(0, 1000, cfg, 600.0) == pytest.approx(0.0)
    assert lr_at(550, 1000, cfg, 0.0) == pytest.approx(0.5)  # the steps run out first: they lead
    steps = TrainConfig(lr=1.0, warmup=0.1)  # without minutes the clock is ignored
    assert lr_at(550, 1000, steps, 1e9) == lr_at(550, 1000, steps) == pytest.approx(0.5)


@pytest.mark.parametrize("argv,needle", [
    (["--epochs", "0"], "--epochs must be > 0"),
    (["--minutes", "-1"], "--minutes must be > 0 minutes"),
    (["--block-size", "1"], "--block-size must be in 2..64"),
    (["--prompts", "nope.jsonl"], "--prompts nope.jsonl: no such file"),
    (["--mask-token-id", "99999"], "--mask-token-id 99999 is outside the vocabulary"),
    (["--branches", "-1"], "--branches must be >= 0"),
    (["--branches", "2", "--temperature", "0.7"], "--branches continues greedy replies: it needs --temperature 0"),
])
def test_bad_train_arguments_are_one_line_errors(argv, needle, target, tmp_path, capsys):
    base = ["train", "dflash", "--target", target, "--out", str(tmp_path / "o"), "--device", "cpu", "--no-chat",
            "--data-cache", str(tmp_path / "c"), "--max-new-tokens", "4", "--prompts", str(tmp_path / "p.txt"),
            "--eval-prompts", "1"]
    (tmp_path / "p.txt").write_text("one\ntwo\nthree\n")
    rc = main(base + argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "o")


def test_bad_prompt_record_names_file_and_line(target, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": 3}\n')
    rc = main(["train", "mtp", "--target", target, "--out", str(tmp_path / "o"), "--prompts", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad}:2: record without a string 'prompt'" in err


def test_reply_cache_serves_any_split_and_a_new_output_folder(target, prompts, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    rc, _, err = _train(capsys, target, prompts, str(tmp_path / "a"), cache, "mtp", "--distill-only",
                        "--draft-vocab-size", "30")
    assert rc == 0 and "distilled 38 replies" in err
    assert len(json.load(open(tmp_path / "a" / "draft_vocab.json"))["token_ids"]) == 30  # the replies' vocabulary alone
    # another held-out split and fewer prompts: every reply is already cached
    rc, _, err = _train(capsys, target, prompts, str(tmp_path / "b"), cache, "mtp", "--distill-only",
                        "--eval-prompts", "5", "--max-prompts", "20")
    assert rc == 0 and "distilling" not in err and "data: 20 prompts" in err
    # the checkpoint of an output in a folder that does not exist yet
    out = str(tmp_path / "new" / "deeper" / "m")
    rc, _, err = _train(capsys, target, prompts, out, cache, "mtp", "--time-limit", "1e-6")
    assert rc == 3 and os.path.exists(out + ".ckpt.pt")


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_init_continues_from_a_trained_drafter(kind, target, prompts, tmp_path, capsys):
    cache, first, second = str(tmp_path / "cache"), str(tmp_path / "one"), str(tmp_path / "two")
    rc, _, err = _train(capsys, target, prompts, first, cache, kind, "--epochs", "3")
    assert rc == 0, err
    rc, _, err = _train(capsys, target, prompts, second, cache, kind, "--epochs", "3", "--init", first, arch=False)
    assert rc == 0, err
    a = json.load(open(os.path.join(first, "training.json")))
    b = json.load(open(os.path.join(second, "training.json")))
    assert b["first_epoch_loss"] < a["first_epoch_loss"]  # it starts where the first run ended, not from scratch
    _lossless(target, f"{kind}:{second}", prompts)


def test_branches_are_greedy_continuations_after_a_token_not_chosen(target, prompts, tmp_path, monkeypatch):
    from specdec.loading import load_model
    from specdec.train import data as data_mod

    loaded = load_model(target, "cpu", None)
    stop = set(loaded.tokenizer.eos_ids)
    texts, cache, n_new = data_mod.read_prompts(prompts)[:8], str(tmp_path / "cache"), 24
    base = data_mod.distill(loaded, texts, max_new_tokens=n_new, temperature=0.0, seed=0, slots=4, cache_dir=cache,
                            chat=False)
    more = data_mod.branch(loaded, base, 2, max_new_tokens=n_new, seed=0, slots=3, cache_dir=cache, batch_tokens=96)
    assert len(more.prompts) == sum(min(2, len(r) - 1) for r in base.replies if len(r) >= 2) > 8
    plain = LLM(target, device="cpu")
    points = set()
    for prompt, reply in zip(more.prompts, more.replies):
        i = next(i for i, p in enumerate(base.prompts) if prompt[: len(p)] == p)
        p = len(prompt) - len(base.prompts[i]) - 1
        assert prompt[len(base.prompts[i]): -1] == base.replies[i][:p]  # the greedy reply up to the branch point,
        assert prompt[-1] != base.replies[i][p] and prompt[-1] not in stop  # then a token the target did not choose
        ref = plain.generate(prompt, max_new_tokens=n_new - p - 1).token_ids
        assert reply == ref  # and from there the target's own greedy continuation
        points.add(p)
    assert len(points) > 3  # branch points all over the replies, not one place
    # a sharp target (logits x 50) would nearly always sample its greedy token: never drawn; its second choice at
    # that position (read here from the plain forward of the context) nearly always
    head = loaded.model.head
    monkeypatch.setattr(loaded.model, "head", lambda h, exact=True: head(h, exact) * 50)
    src = [i for i, r in enumerate(base.replies) if len(r) >= 2]
    second, ref_target = 0, Target(load_model(target, "cpu", None))
    for i, p, x in data_mod._draw_branches(loaded.model, base, src, 3, stop, 1, 96):
        assert x != base.replies[i][p] and x not in stop
        last = ref_target.logits(base.prompts[i] + base.replies[i][:p])[-1].clone()
        last[[base.replies[i][p], *stop]] = float("-inf")
        second += x == int(last.argmax())
    assert second >= 0.9 * sum(min(3, len(base.replies[i]) - 1) for i in src)
    # drawn once: a rerun reads the points and the continuations from the cache, whatever the batch
    monkeypatch.setattr(loaded.model, "forward_batch_train", lambda *a, **k: 1 / 0)
    monkeypatch.setattr("specdec.engine.batch.generate_batch", lambda *a, **k: 1 / 0)
    again = data_mod.branch(loaded, base, 2, max_new_tokens=n_new, seed=0, slots=7, cache_dir=cache, batch_tokens=512)
    assert (again.prompts, again.replies) == (more.prompts, more.replies)
    part = data_mod.branch(loaded, data_mod.Distilled(base.prompts[3:6], base.replies[3:6], base.key), 2,
                           max_new_tokens=n_new, seed=0, slots=2, cache_dir=cache)  # another split: the same branches
    assert part.prompts and all(p in more.prompts for p in part.prompts)
    both = base + more
    assert len(both.sequences()) == len(base.sequences()) + len(more.sequences())


def test_distill_only_with_branches(target, prompts, tmp_path, capsys):
    rc, _, err = _train(capsys, target, prompts, str(tmp_path / "a"), str(tmp_path / "cache"), "dflash",
                        "--distill-only", "--branches", "1")
    assert rc == 0 and "distilled 38 replies" in err and "continued 38 replies" in err, err
    assert "branches: 38 more replies" in err


def test_reply_cache_round_trips_small_and_large_ids(tmp_path):
    from specdec.train.data import _load_replies, _save_replies

    for replies in ({3: [0, 5, 65535], 9: [], 1: [40000, 2]}, {7: [70000, 1], 2: [3]}):
        path = str(tmp_path / "r.pt")
        _save_replies(path, replies)
        assert _load_replies(path) == replies
    (tmp_path / "bad.pt").write_bytes(b"not a cache")
    with pytest.raises(Exception, match="unreadable reply cache"):
        _load_replies(str(tmp_path / "bad.pt"))


def test_target_fingerprint_is_content_not_name(tmp_path):
    # the reply cache is keyed by it: a renamed or copied target must find its replies
    from specdec.train.data import target_fingerprint
    blob = os.urandom(3 << 20)
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(blob)
    assert target_fingerprint(str(tmp_path / "a.gguf")) == target_fingerprint(str(tmp_path / "b.gguf"))
    (tmp_path / "b.gguf").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert target_fingerprint(str(tmp_path / "a.gguf")) != target_fingerprint(str(tmp_path / "b.gguf"))
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    for d, name in ((d1, "model.safetensors"), (d2, "other.safetensors")):
        d.mkdir()
        (d / name).write_bytes(blob)
    assert target_fingerprint(str(d1)) != target_fingerprint(str(d2))  # in a directory, names matter
