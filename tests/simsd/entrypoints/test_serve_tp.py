"""``simsd serve --tp 2`` (CPU, gloo, the bundled pair in float64): rank 0 serves and leads the
rounds, rank 1 runs them from rank 0's broadcast inputs (simsd/engine/tp_rounds.py). The answers
equal ``--tp 1``'s token for token (completions and chat, streamed and not, greedy and seeded
sampling, exact and vanilla modes), also for concurrent requests and after a cancelled stream (the
ranks stay in step); SIGTERM and SIGINT on the launcher end every rank; a rank that dies ends the
server instead of leaving it hanging."""
import json
import os
import signal
import threading
import time

import pytest

from tests.simsd.entrypoints.serving import stream_in_background
from tests.simsd.entrypoints.test_serve_cli import TIMEOUT, serve_process, wait_healthy

MODEL = "tiny-sdar-target"
ARGV = ("--dtype", "float64", "--max-model-len", "512")  # float64: a sharded sum rounds as the whole one
GREEDY = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 24, "temperature": 0}
SEEDED = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "seed": 7}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Write a function that reverses a list."}],
        "max_tokens": 20, "temperature": 0.8, "seed": 3}
CHAT_GREEDY = {**CHAT, "temperature": 0, "seed": None}
LONG = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 400, "ignore_eos": True, "temperature": 0.7,
        "seed": 5}


def children(pid: int) -> list:
    """The pids whose parent is ``pid`` (from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = open(f"/proc/{name}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(name))
    return out


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def ranks_of(proc) -> list:
    """The launcher's rank processes (and multiprocessing's resource tracker), once both ranks run."""
    end = time.monotonic() + TIMEOUT
    while len(kids := children(proc.pid)) < 3:  # two ranks and the resource tracker
        assert time.monotonic() < end and proc.poll() is None, kids
        time.sleep(0.1)
    return kids


def answer(httpx, url, body) -> tuple:
    """``(text, completion_tokens, finish_reason)`` of a request, streamed when ``body`` says so."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {k: v for k, v in body.items() if v is not None}
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        text = choice["message"]["content"] if "messages" in body else choice["text"]
        return text, out["usage"]["completion_tokens"], choice["finish_reason"]
    body = {**body, "stream_options": {"include_usage": True}}
    pieces, usage, finish = [], None, None
    with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for c in event["choices"]:
                pieces.append(c["delta"].get("content") or "" if "messages" in body else c["text"])
                finish = c.get("finish_reason") or finish
    return "".join(pieces), usage["completion_tokens"], finish


def concurrently(httpx, url, bodies) -> list:
    outs = [None] * len(bodies)

    def run(i):
        outs[i] = answer(httpx, url, bodies[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    return outs


def cancel_a_stream(httpx, url) -> None:
    """Open a long stream, read a few chunks and hang up (the server cancels its engine request)."""
    with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    end = time.monotonic() + TIMEOUT  # the row is freed
    while (h := httpx.get(url + "/health", timeout=TIMEOUT).json())["running"] + h["waiting"]:
        assert time.monotonic() < end, h
        time.sleep(0.05)


SINGLE = {"greedy": GREEDY, "seeded": SEEDED, "chat": CHAT, "chat-greedy": CHAT_GREEDY,
          "greedy-stream": {**GREEDY, "stream": True}, "seeded-stream": {**SEEDED, "stream": True},
          "chat-stream": {**CHAT, "stream": True}}
TOGETHER = [{**SEEDED, "seed": s, "max_tokens": 16 + 4 * s} for s in range(3)] + [{**CHAT, "stream": True}]


def session(httpx, url) -> dict:
    """The answers to every request of the comparison, in the same order on each server."""
    out = {name: answer(httpx, url, body) for name, body in SINGLE.items()}
    out["together"] = concurrently(httpx, url, TOGETHER)  # 2 rows: two run, two wait
    cancel_a_stream(httpx, url)
    out["after-cancel"] = concurrently(httpx, url, [GREEDY, {**CHAT, "stream": True}])
    return out


@pytest.mark.parametrize("mode", ["exact", "vanilla"])
def test_serve_tp2_answers_as_tp1(mode):
    httpx = pytest.importorskip("httpx")
    with serve_process("--tp", "2", "--mode", mode, *ARGV) as (proc2, url2), \
            serve_process("--mode", mode, *ARGV) as (proc1, url1):
        wait_healthy(httpx, proc1, url1)
        one = session(httpx, url1)
        wait_healthy(httpx, proc2, url2)
        kids = ranks_of(proc2)
        two = session(httpx, url2)
        for name in one:
            assert two[name] == one[name], name
        assert one["greedy"][1] == 24 and one["seeded"][0] != one["greedy"][0]  # real answers, not empty ones
        proc2.send_signal(signal.SIGTERM)
        assert proc2.wait(TIMEOUT) == 0, proc2.stderr.read()
        err = proc2.stderr.read()
        assert "(13 requests finished, 1 cancelled, 0 failed)" in err, err
        assert "Traceback" not in err, err
        end = time.monotonic() + 30
        while any(alive(k) for k in kids):  # the ranks and the resource tracker have ended
            assert time.monotonic() < end, [k for k in kids if alive(k)]
            time.sleep(0.1)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_serve_tp2_signal_ends_every_rank_after_the_request_in_flight(sig):
    httpx = pytest.importorskip("httpx")
    with serve_process("--tp", "2", *ARGV) as (proc, url):
        wait_healthy(httpx, proc, url)
        kids = ranks_of(proc)
        reader, events = stream_in_background(httpx, url, {**LONG, "max_tokens": 64, "stream": True}, TIMEOUT)
        proc.send_signal(getattr(signal, sig))  # the launcher passes it on to rank 0, which drains
        reader.join(TIMEOUT)
        assert proc.wait(TIMEOUT) == 0, proc.stderr.read()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 64
        assert "(1 requests finished, 0 cancelled, 0 failed)" in proc.stderr.read()
        end = time.monotonic() + 30
        while any(alive(k) for k in kids):
            assert time.monotonic() < end, [k for k in kids if alive(k)]
            time.sleep(0.1)


def test_serve_tp2_a_dead_rank_ends_the_server():
    """Rank 1 killed during a request: the request fails (no hang), the server exits 1 saying so
    and no rank is left."""
    httpx = pytest.importorskip("httpx")
    with serve_process("--tp", "2", *ARGV) as (proc, url):
        wait_healthy(httpx, proc, url)
        kids = ranks_of(proc)
        reader, events = stream_in_background(httpx, url, {**LONG, "max_tokens": 480, "stream": True}, TIMEOUT)
        rank1 = max(k for k in kids if "spawn_main" in open(f"/proc/{k}/cmdline").read())
        os.kill(rank1, signal.SIGKILL)
        reader.join(TIMEOUT)
        assert not reader.is_alive()
        assert proc.wait(TIMEOUT) == 1
        assert "a tensor-parallel rank failed" in proc.stderr.read()
        # the stream ends with the request's error (the all-reduce with the dead rank failed), not a hang
        assert events[-1] == "[DONE]" and "tensor-parallel" not in events[-2], events[-3:]
        assert json.loads(events[-2])["error"]["type"] == "server_error", events[-3:]
        end = time.monotonic() + 30
        while any(alive(k) for k in kids):
            assert time.monotonic() < end, [k for k in kids if alive(k)]
            time.sleep(0.1)


def test_serve_tp2_refuses_a_taken_port_at_once():
    """Rank 0 checks the address before the models load: a taken port is one line, exit 2, and the
    other rank (loading, or waiting for rank 0) is ended with it."""
    import socket
    import subprocess
    import sys
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "simsd.entrypoints.cli", "serve", "--tp", "2", "--port", str(port)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[0].startswith(f"simsd: error: --host 127.0.0.1 --port {port}: cannot listen "), \
        proc.stderr
