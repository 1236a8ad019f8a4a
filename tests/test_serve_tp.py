"""``specdec serve --tensor-parallel 2`` on the CPU (gloo, 2 spawned ranks) with a tiny random Llama:
concurrent replies (completions, chat, a streamed chat, greedy and seeded sampled, n-gram drafts
accepted) equal the same server's at TP=1; an idle server neither spins nor times out; Ctrl-C
and a follower's death end every process. Servers run as subprocesses in sessions of their own,
on 127.0.0.1, and every wait is bounded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

import specdec
from _fuzz_util import smollm2_vocab, write_gguf_seed
from _tp_util import serve_after_idle_on_rank
from specdec.parallel.launch import run_parallel

START_S = 120.0  # a server must be up within this (three processes import torch on a shared CPU)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(specdec.__file__)))


@pytest.fixture(autouse=True)
def ctrl_c_as_in_a_terminal():
    """The servers get Ctrl-C as a terminal's foreground job does. A test run started in the background
    by a non-interactive shell ignores SIGINT, and a child inherits an ignored signal (never a handler):
    the server would then never see the Ctrl-C these tests send. A handler here starts them with the default."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("serve_tp") / "tiny.gguf")
    write_gguf_seed(path, smollm2_vocab())
    return path


class Served:
    """``specdec serve`` in a subprocess that leads a session of its own (a terminal's Ctrl-C reaches
    its whole process group: :meth:`interrupt` does the same)."""

    def __init__(self, path: str, tp: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, "-m", "specdec", "serve", "--model", path, "--device", "cpu", "--port", "0",
               "--draft", "ngram", "--max-slots", "4", "--served-model-name", "tiny", "--log-level", "info", "--tensor-parallel", str(tp)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        self.port = None

    def wait_up(self) -> str:
        deadline = time.monotonic() + START_S
        while self.port is None:
            found = [m for line in list(self.lines) if (m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line))]
            if found:
                self.port = int(found[0].group(1))
            else:
                assert self.proc.poll() is None, f"the server exited: {self.stderr()}"
                assert time.monotonic() < deadline, f"the server did not start: {self.stderr()}"
                time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}/v1"

    def stderr(self) -> str:
        return "".join(self.lines)

    def ranks(self) -> tuple[psutil.Process, list[psutil.Process]]:
        """(rank 0: the child listening on the HTTP port, the other ranks)."""
        kids = [p for p in psutil.Process(self.proc.pid).children()
                if "resource_tracker" not in " ".join(p.cmdline())]
        lead = [p for p in kids if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                                       for c in p.net_connections(kind="tcp"))]
        assert len(lead) == 1 and len(kids) == 2, kids
        return lead[0], [p for p in kids if p.pid != lead[0].pid]

    def interrupt(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def end(self, timeout: float = 30.0) -> int:
        """The exit code once the server ends; every process of its session must be gone."""
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        deadline = time.monotonic() + 10
        while left := _in_session(self.proc.pid):
            assert time.monotonic() < deadline, f"processes left running: {left}"
            time.sleep(0.1)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _in_session(sid: int) -> list[int]:
    out = []
    for p in psutil.pids():
        try:
            if os.getsid(p) == sid and psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _client(url: str):
    import openai
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


REPEAT = "the cat sat on the mat. the cat sat on the mat. the cat sat on"  # n-gram drafts get accepted
CASES = [
    ("completion", REPEAT, {}),
    ("completion", "hello world", {}),
    ("chat", "hi there", {}),
    ("stream", "the dog and the dog and the dog and the", {}),
    ("completion", "the sun", {"temperature": 1.0, "seed": 7}),
]


def _ask(url: str, case) -> str:
    kind, text, extra = case
    client, kw = _client(url), {"model": "tiny", "max_tokens": 16, "temperature": 0, **extra}
    if kind == "completion":
        return client.completions.create(prompt=text, **kw).choices[0].text
    msgs = [{"role": "user", "content": text}]
    if kind == "chat":
        return client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(messages=msgs, stream=True,
                                                                                            **kw) if c.choices)


def _replies(url: str) -> list[str]:
    with ThreadPoolExecutor(len(CASES) + 1) as pool:
        unseeded = pool.submit(_client(url).completions.create, model="tiny", prompt=REPEAT, max_tokens=16,
                               temperature=1.0)  # the ranks must agree on its seed, or they would part ways
        got = list(pool.map(lambda c: _ask(url, c), CASES))
        assert unseeded.result().usage.completion_tokens >= 1
    return got


def test_replies_equal_single_process_then_ctrl_c_ends_every_rank(tiny):
    one, two = Served(tiny, 1), Served(tiny, 2)
    try:
        want, url = _replies(one.wait_up()), two.wait_up()
        one.interrupt()
        assert _replies(url) == want
        assert _replies(url) == want  # once more: the ranks stayed together
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
        accepted = float(re.search(r"^specdec_engine_accepted_total (\S+)$", metrics, re.M).group(1))
        assert accepted > 0  # drafts were accepted: the sharded verify rolled back rejected rows
        # idle: the followers wait in a blocking read (rank 0 sends a heartbeat every few seconds)
        _, followers = two.ranks()
        before = [sum(p.cpu_times()[:2]) for p in followers]
        time.sleep(2.0)
        busy = [sum(p.cpu_times()[:2]) - b for p, b in zip(followers, before)]
        assert max(busy) < 0.5, f"an idle follower used {busy} s of CPU in 2 s"
        two.interrupt()  # Ctrl-C: rank 0 stops the loop, the followers end with it
        assert two.end() == 130, two.stderr()
        assert one.end() == 130, one.stderr()
    finally:
        one.kill()
        two.kill()


def test_follower_dying_ends_the_server_with_one_error(tiny):
    two = Served(tiny, 2)
    try:
        url = two.wait_up()
        _, (follower,) = two.ranks()
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(lambda: _client(url).completions.create(model="tiny", prompt=REPEAT, max_tokens=200,
                                                                       temperature=0))
            time.sleep(0.2)
            follower.kill()
            assert two.end() == 2, two.stderr()
            try:  # the request fails with the server, unless it was answered before the kill
                busy.result(timeout=30)
            except Exception:  # noqa: BLE001 - either way it ended
                pass
        errors = [line for line in two.stderr().splitlines() if "error" in line]
        assert errors == ["specdec serve: error: rank 1 failed: exited with code -9 without reporting"], two.stderr()
    finally:
        two.kill()


def test_idle_longer_than_the_collective_timeout_and_rank_0_chooses_k(tiny):
    """Rank 0's heartbeat (an empty boundary every 0.5 s here) keeps the followers' broadcast from
    timing out (4 s here: well above the ranks' start-up skew) while no request comes for 6 s; then
    the loop serves what one process does."""
    from specdec import LLM

    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    got, ks, follower_ks = run_parallel(serve_after_idle_on_rank, 2, tiny, prompt, 6.0, timeout_s=4.0,
                                        deadline_s=120.0)
    assert got == LLM(tiny, device="cpu").generate(prompt, 8).token_ids
    assert len(ks) > 1 and follower_ks == ks  # k changed from step to step, on both ranks alike
