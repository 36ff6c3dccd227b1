"""Probes of ``simsd serve`` under the faults of issue 26, on loopback with the bundled pair.

    python bench/probe_server.py [--repo DIR] [--python EXE] [--sizes 1,4,20] [--in-flight 8]
                                 [--max-tokens 300] [--requests 120] [--only large,signals,codes,load,doors]
                                 [--out FILE]

``--repo``/``--python``: the checkout whose ``simsd serve`` is probed (default: this one, with
the running interpreter), e.g. an older commit in its own worktree; options that checkout's
``simsd serve --help`` does not list are left out (and say so in the row). Every server is a
fresh process on 127.0.0.1 and a free port; nothing else is contacted.

(a) ``large``: while one request with a prompt of S MB (``"a " * S/2 MiB``) is in flight, another
client's stream (1900 tokens) and ``/health`` (polled every 50 ms) are watched: the longest
pause between the stream's chunks and the slowest ``/health`` in that window (and, as the
baseline, in the 3 s before it), the large request's status and seconds, the server's RSS
before and after; with the default body limit
and with ``--max-request-bytes`` raised to 64 MiB (where the option exists).
(b) ``signals``: ``--in-flight`` requests (half streaming) of ``--max-tokens`` tokens on as many
rows, then SIGTERM / SIGINT in each order (TERM, TERM+TERM, TERM+INT, INT, INT+INT; a second
signal 0.5 s after the first; ``--shutdown-timeout 5`` where the option exists): the status
of a new request 0.5 s after the first signal, what each client got (HTTP status, or for a
stream: ``done``, ``error-chunk`` or ``cut``), seconds from the first signal to the last
answer and to the process's exit (killed after 240 s).
(c) ``codes``: status codes of a wrong API key, a CORS preflight, 100 prompts on an 8-row
server (``--max-waiting 64``), a request with ``null`` OpenAI fields.
(d) ``load``: the load and fault probes the server passed before issue 26, run again on one
8-row server: ``--requests`` mixed requests (completions and chat, streamed or not, greedy and
seeded sampling, 4 to 40 tokens) sent at concurrency 1, 4, 16 and 16 again, each answer compared
with the same request's answer at concurrency 1 (alone: text, finish reason, token counts), the
RSS after each pass; clients
that go away after their first streamed chunk (the seconds until ``/health`` shows no request
running); a slow reader (a stream read one chunk per 0.2 s) while a quick request is answered;
bad inputs (malformed JSON, wrong types, unknown fields and models, out-of-range values),
each answered with a 4xx and OpenAI's error body, with no traceback on the server's stderr;
the RSS before and after.
(e) ``doors`` (issue 34's server items; not run by default): on a 2-row server (``--allowed-origins
https://app.example``, ``--request-read-timeout 5`` where the option exists) while another client
streams 1900 tokens: a request of 300 tokens with 20,000 stop strings against the same request
without them (the stream's mean chunk interval during each, and their ratio), a body of 400,000
unknown fields (its status and seconds, the stream's longest pause and the slowest ``/health``
meanwhile); the OpenAI browser SDK's CORS preflight; a 1 MiB request header; an endless header
line (MiB the server read before it cut the connection, of 64 sent, and its RSS growth); a
half-sent request head after 10 s; ``continue_final_message``; on a 1-row server, a stream queued
behind a 1900-token one (its first line after the headers and when it came); ``--api-key clé``
(the process refuses it, or serves and answers the key's UTF-8 bytes with a 401).

Times come from one run on whatever machine runs it: on a loaded machine read them as rough
ratios. Rows go to ``--out`` (JSON) and a table to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[1]
MODEL = "tiny-sdar-target"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``simsd serve`` process of ``repo`` with ``options`` (those its --help lacks dropped)."""

    def __init__(self, repo: Path, python: str, options: dict, help_text: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dropped = [k for k in options if k not in help_text]
        argv = [python, "-m", "simsd.entrypoints.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        for k, v in options.items():
            if k not in self.dropped:
                argv += [k] if v is None else [k, str(v)]
        self.err = open(f"/tmp/probe_server_{os.getpid()}_{self.port}.err", "w+")
        self.proc = subprocess.Popen(argv, cwd=repo, stdout=subprocess.DEVNULL, stderr=self.err,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        end = time.monotonic() + 300
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simsd serve exited: {self.stderr()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("simsd serve did not become healthy")

    def rss_mb(self) -> float:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.err.close()
        os.unlink(self.err.name)


def long_body(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def read_stream(url: str, body: dict, out: dict) -> None:
    """Stream ``body``; ``out``: chunk arrival times and the outcome (done / error-chunk / cut / status)."""
    out["times"], out["outcome"] = [], "cut"
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                out["outcome"] = str(r.status_code)
                return
            for line in r.iter_lines():
                if out.get("stop") is not None and out["stop"].is_set():
                    break  # the client goes: the server cancels the request
                if line.startswith("data: "):
                    out["times"].append(time.monotonic())
                    if line == "data: [DONE]":
                        out["outcome"] = "done" if out["outcome"] != "error-chunk" else "error-chunk"
                    elif '"error"' in line[:20]:
                        out["outcome"] = "error-chunk"
    except httpx.HTTPError:
        pass
    out["ended"] = time.monotonic()


def post(url: str, body, out: dict, **kwargs) -> None:
    """POST ``body`` (a dict, or JSON already encoded: bytes) to /v1/completions; ``out``: outcome, end time."""
    data = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    try:
        r = httpx.post(url + "/v1/completions", timeout=600, **data, **kwargs)
        out["outcome"] = str(r.status_code)
    except httpx.HTTPError as exc:
        out["outcome"] = type(exc).__name__
    out["ended"] = time.monotonic()


def probe_large(repo, python, help_text, sizes, raise_limit: bool) -> list:
    rows = []
    opts = {"--max-batch-size": 2}
    if raise_limit:
        opts["--max-request-bytes"] = 64 * 2 ** 20
    srv = Server(repo, python, opts, help_text)
    try:
        for mb in sizes:
            rss0 = srv.rss_mb()
            # encoded before the window: the probe's own JSON encoding would pause its threads too
            body = json.dumps({"model": MODEL, "prompt": "a " * (mb * 2 ** 19), "max_tokens": 4}).encode()

            def send():
                big = {}
                post(srv.url, body, big)
                return {"status": big["outcome"]}
            seen = watch(srv, send)
            limit = "raised" if raise_limit and not srv.dropped else "default"
            rows.append({"probe": "large", "mb": mb, "limit": limit, **seen, "rss_before_mb": round(rss0),
                         "rss_after_mb": round(srv.rss_mb()), "dropped": srv.dropped})
            print(rows[-1], flush=True)
    finally:
        srv.stop()
    return rows


def probe_signals(repo, python, help_text, order, n, max_tokens) -> dict:
    srv = Server(repo, python, {"--max-batch-size": n, "--shutdown-timeout": 5}, help_text)
    try:
        outs = [{} for _ in range(n)]
        threads = [threading.Thread(target=read_stream if i % 2 == 0 else post,
                                    args=(srv.url, long_body(max_tokens, i % 2 == 0), outs[i])) for i in range(n)]
        for t in threads:
            t.start()
        end = time.monotonic() + 300
        while httpx.get(srv.url + "/health", timeout=60).json().get("running", 0) < n and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.proc.send_signal(getattr(signal, order[0]))
        time.sleep(0.5)
        late = {}
        post(srv.url, {"model": MODEL, "prompt": "hi", "max_tokens": 4}, late)
        if len(order) > 1:
            time.sleep(max(0.0, t0 + 0.5 - time.monotonic()))
            srv.proc.send_signal(getattr(signal, order[1]))
        for t in threads:
            t.join(240)
        answered = max(o.get("ended", float("nan")) for o in outs) - t0
        try:
            code = srv.proc.wait(max(1, 240 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            code = "killed"
        exited = time.monotonic() - t0
        err = srv.stderr()
        got = {}
        for o in outs:
            got[o.get("outcome", "none")] = got.get(o.get("outcome", "none"), 0) + 1
        row = {"probe": "signals", "order": "+".join(s[3:] for s in order), "new_request": late["outcome"],
               "clients": got, "last_answer_s": round(answered, 1), "exit_s": round(exited, 1), "exit_code": code,
               "event_loop_closed_lines": err.count("Event loop is closed"), "dropped": srv.dropped}
        print(row, flush=True)
        return row
    finally:
        srv.stop()


def probe_codes(repo, python, help_text) -> dict:
    srv = Server(repo, python, {"--max-batch-size": 8, "--max-waiting": 64, "--api-key": "k",
                                "--allowed-origins": "https://app.example"}, help_text)
    try:
        key = {"Authorization": "Bearer k"}
        row = {"probe": "codes", "dropped": srv.dropped}
        row["wrong_key"] = httpx.post(srv.url + "/v1/completions", headers={"Authorization": "Bearer wrong"},
                                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=600).status_code
        row["cors_preflight"] = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}, timeout=60).status_code
        row["100_prompts_8_rows"] = httpx.post(srv.url + "/v1/completions", headers=key, timeout=600, json={
            "model": MODEL, "prompt": ["hi"] * 100, "max_tokens": 2}).status_code
        row["null_fields"] = httpx.post(srv.url + "/v1/completions", headers=key, timeout=600, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 2, "n": None, "echo": None, "stream": None,
            "presence_penalty": None}).status_code
        print(row, flush=True)
        return row
    finally:
        srv.stop()


def load_bodies(n: int) -> list:
    """``n`` mixed requests: ``(path, body)``, completions and chat, streamed or not, greedy or seeded."""
    prompts = ["Once upon a time", "Write a function that reverses a list.", "What is 2 + 2?", "Tell me a story.",
               "Why is the sky blue?", "def add(a, b):"]
    out = []
    for i in range(n):
        body = {"model": MODEL, "max_tokens": 4 + (i * 7) % 37, "stream": i % 3 == 0}
        if i % 2:
            body["temperature"], body["seed"] = 0.8, 1000 + i
        if i % 4 < 2:
            out.append(("/v1/completions", {**body, "prompt": prompts[i % len(prompts)]}))
        else:
            out.append(("/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                                        "content": prompts[i % len(prompts)]}]}))
    return out


def answer_of(url: str, path: str, body: dict) -> tuple:
    """``(text, finish_reason, completion_tokens)`` of one request (a stream's pieces joined)."""
    chat = path.endswith("chat/completions")
    if not body["stream"]:
        r = httpx.post(url + path, json=body, timeout=600)
        if r.status_code != 200:
            return ("HTTP", r.status_code, None)
        c, usage = r.json()["choices"][0], r.json()["usage"]
        return (c["message"]["content"] if chat else c["text"], c["finish_reason"], usage["completion_tokens"])
    text, finish, tokens = "", None, None
    with httpx.stream("POST", url + path, json={**body, "stream_options": {"include_usage": True}},
                      timeout=600) as r:
        if r.status_code != 200:
            return ("HTTP", r.status_code, None)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                text += (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
                finish = c.get("finish_reason") or finish
    return (text, finish, tokens)


BAD_INPUTS = [
    b"{", b"[]", b"null", b'"text"', b'{"model": "tiny-sdar-target"}',
    {"prompt": "hi"}, {"model": "other", "prompt": "hi"}, {"model": MODEL, "prompt": "hi", "max_tokens": 0},
    {"model": MODEL, "prompt": "hi", "max_tokens": -1}, {"model": MODEL, "prompt": "hi", "max_tokens": "5"},
    {"model": MODEL, "prompt": "hi", "max_tokens": True}, {"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 9},
    {"model": MODEL, "prompt": "hi", "temperature": -1}, {"model": MODEL, "prompt": "hi", "temperature": "hot"},
    {"model": MODEL, "prompt": "hi", "top_p": 0}, {"model": MODEL, "prompt": "hi", "top_p": 1.5},
    {"model": MODEL, "prompt": "hi", "top_k": -2}, {"model": MODEL, "prompt": "hi", "seed": -1},
    {"model": MODEL, "prompt": "hi", "seed": 2 ** 64}, {"model": MODEL, "prompt": "hi", "n": 2},
    {"model": MODEL, "prompt": "hi", "logprobs": 3}, {"model": MODEL, "prompt": "hi", "unknown_field": 1},
    {"model": MODEL, "prompt": ""}, {"model": MODEL, "prompt": []}, {"model": MODEL, "prompt": [-1]},
    {"model": MODEL, "prompt": [10 ** 9]}, {"model": MODEL, "prompt": [[1, 2], "x"]}, {"model": MODEL, "prompt": 5},
    {"model": MODEL, "prompt": "hi", "stop": 5}, {"model": MODEL, "prompt": "hi", "stream": "yes"},
    {"model": MODEL, "prompt": "hi", "strategy": "nope"}, {"model": MODEL, "prompt": "hi", "steps": 0},
    {"model": MODEL, "prompt": [11] * 5000},
]
BAD_CHAT = [
    {"model": MODEL, "messages": []}, {"model": MODEL, "messages": "hi"},
    {"model": MODEL, "messages": [{"role": "user"}]}, {"model": MODEL, "messages": [{"role": "user", "content": []}]},
    {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
]


def probe_load(repo, python, help_text, n: int) -> dict:
    srv = Server(repo, python, {"--max-batch-size": 8}, help_text)
    try:
        from concurrent.futures import ThreadPoolExecutor
        rss0 = srv.rss_mb()
        bodies = load_bodies(n)
        answers, rss = {}, {}
        passes = ((1, 1), (4, 4), (16, 16), ("16 again", 16))  # the last: is the RSS flat after warm-up?
        for name, c in passes:
            with ThreadPoolExecutor(c) as pool:
                answers[name] = list(pool.map(lambda pb: answer_of(srv.url, *pb), bodies))
            rss[name] = round(srv.rss_mb())
        alone = answers[1]
        row = {"probe": "load", "dropped": srv.dropped, "requests": n,
               "failed_alone": sum(a[0] == "HTTP" for a in alone),
               "equal_to_alone": {name: sum(a == b for a, b in zip(answers[name], alone)) for name, _ in passes},
               "rss_after_pass_mb": rss}
        # clients that go away after the first chunk
        gone, stops = 20, []
        for _ in range(gone):
            out = {"stop": threading.Event()}
            out["stop"].set()  # leave after the first line
            stops.append(out)
        t0 = time.monotonic()
        with ThreadPoolExecutor(gone) as pool:
            list(pool.map(lambda o: read_stream(srv.url, long_body(1500, True), o), stops))
        left = time.monotonic()
        while httpx.get(srv.url + "/health", timeout=60).json().get("running", 0) and time.monotonic() < left + 60:
            time.sleep(0.02)
        row["disconnects"] = gone
        row["disconnects_freed_s"] = round(time.monotonic() - left, 2)
        row["disconnect_round_s"] = round(left - t0, 2)
        # a slow reader while a quick request runs
        slow = {"times": []}

        def slow_reader():
            with httpx.stream("POST", srv.url + "/v1/completions", json=long_body(200, True), timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        slow["times"].append(time.monotonic())
                        time.sleep(0.2)
        quick_body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 16}
        t = time.monotonic()
        httpx.post(srv.url + "/v1/completions", json=quick_body, timeout=600)
        row["quick_alone_s"] = round(time.monotonic() - t, 2)
        reader = threading.Thread(target=slow_reader)
        reader.start()
        while not slow["times"]:
            time.sleep(0.01)
        t = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json=quick_body, timeout=600)
        row["quick_beside_slow_reader_s"] = round(time.monotonic() - t, 2)
        row["quick_status"] = r.status_code
        reader.join(600)
        # bad inputs
        codes = {}
        shaped = 0
        for path, items in (("/v1/completions", BAD_INPUTS), ("/v1/chat/completions", BAD_CHAT)):
            for b in items:
                data = {"content": b} if isinstance(b, bytes) else {"content": json.dumps(b).encode()}
                res = httpx.post(srv.url + path, headers={"Content-Type": "application/json"}, timeout=600, **data)
                codes[res.status_code] = codes.get(res.status_code, 0) + 1
                try:
                    err = res.json()["error"]
                    shaped += isinstance(err.get("message"), str) and "type" in err and "param" in err
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass
        row["bad_inputs"] = len(BAD_INPUTS) + len(BAD_CHAT)
        row["bad_input_codes"] = codes
        row["bad_inputs_openai_shaped"] = shaped
        err = srv.stderr()
        row["tracebacks"] = err.count("Traceback")
        row["rss_before_mb"], row["rss_after_mb"] = round(rss0), round(srv.rss_mb())
        print(row, flush=True)
        return row
    finally:
        srv.stop()


def watch(srv, action) -> dict:
    """``action()`` (returning a dict) while another client streams 1900 tokens and ``/health`` is
    polled every 50 ms: its result, its seconds, the stream's longest pause and mean chunk
    interval and the slowest ``/health`` in that window (``baseline_*``: the 3 s before it)."""
    stream = {"stop": threading.Event()}
    reader = threading.Thread(target=read_stream, args=(srv.url, long_body(1900, True), stream))
    reader.start()
    while not stream.get("times"):
        time.sleep(0.01)
    health, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            t = time.monotonic()
            try:
                httpx.get(srv.url + "/health", timeout=600)
            except httpx.HTTPError:
                pass
            health.append(time.monotonic() - t)
            time.sleep(0.05)
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(3)
    start = time.monotonic()
    base = [start - 3] + [t for t in stream["times"] if start - 3 < t < start] + [start]
    health_base = list(health)
    out = action()
    end = time.monotonic()
    time.sleep(0.5)
    stop.set()
    poller.join()
    inside = [t for t in stream["times"] if start < t < end]
    times = [start] + inside + [end]
    stream["stop"].set()
    reader.join(600)
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    return {**out, "seconds": round(end - start, 2),
            "stream_max_pause_s": round(max(b - a for a, b in zip(times, times[1:])), 2),
            "stream_mean_interval_s": round(sum(gaps) / len(gaps), 3) if gaps else None,
            "health_max_s": round(max(health[len(health_base):]), 2),
            "baseline_pause_s": round(max(b - a for a, b in zip(base, base[1:])), 2),
            "baseline_health_s": round(max(health_base), 2)}


def raw_exchange(url: str, data: bytes, wait: float = 600) -> str:
    """Send ``data`` on a new connection and read until the server closes it: the response's
    status, ``closed`` (closed without an answer) or ``open`` (still open after ``wait`` s)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        got = b""
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                got += chunk
        except socket.timeout:
            return "open" if not got else got.split(b" ")[1].decode()
        except (BrokenPipeError, ConnectionResetError):
            pass
    return got.split(b" ")[1].decode() if got.startswith(b"HTTP/") else "closed"


def endless_header(url: str, srv) -> dict:
    """MiB of an endless header line sent before the server cut the connection (of 64 at most),
    and the server's RSS growth."""
    rss0, sent = srv.rss_mb(), 0
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ")
            for _ in range(1024):
                s.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
        time.sleep(1)
        rss = srv.rss_mb()
    return {"endless_header_sent_mib": round(sent / 2 ** 20, 1), "endless_header_rss_growth_mb": round(rss - rss0)}


def probe_doors(repo, python, help_text) -> list:
    rows = []
    srv = Server(repo, python, {"--max-batch-size": 2, "--allowed-origins": "https://app.example",
                                "--request-read-timeout": 5}, help_text)
    try:
        plain = {"model": MODEL, "prompt": [21, 22, 23], "max_tokens": 300, "ignore_eos": True}
        stops = [f"a stop string, number {i:06d}" for i in range(20000)]

        def ask(body):
            def run():
                out = {}
                post(srv.url, body, out)
                return {"status": out["outcome"]}
            return run
        without = watch(srv, ask(plain))
        with_stops = watch(srv, ask({**plain, "stop": stops}))
        slower = (with_stops["stream_mean_interval_s"] / without["stream_mean_interval_s"]
                  if with_stops["stream_mean_interval_s"] and without["stream_mean_interval_s"] else None)
        rows.append({"probe": "doors", "door": "stop strings", "dropped": srv.dropped, "stop_strings": len(stops),
                     "body_kb": round(len(json.dumps({**plain, "stop": stops})) / 1000), "without": without,
                     "with": with_stops, "stream_interval_ratio": None if slower is None else round(slower, 2)})
        print(rows[-1], flush=True)
        fields = json.dumps({"model": MODEL, "prompt": "hi", **{f"f{i}": 1 for i in range(400000)}}).encode()
        rows.append({"probe": "doors", "door": "400k unknown fields", "body_mb": round(len(fields) / 1e6, 1),
                     **watch(srv, ask(fields))})
        print(rows[-1], flush=True)
        names = "authorization,content-type,openai-organization,x-stainless-lang,x-stainless-os,x-stainless-arch"
        row = {"probe": "doors", "door": "connection", "dropped": srv.dropped}
        row["sdk_preflight"] = httpx.options(srv.url + "/v1/chat/completions", timeout=60, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": names}).status_code
        row["header_1mib"] = raw_exchange(srv.url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2 ** 20
                                          + b"\r\n\r\n", wait=60)
        row.update(endless_header(srv.url, srv))
        row["half_sent_head_after_10s"] = raw_exchange(srv.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                                       wait=10)
        row["continue_final_message"] = httpx.post(srv.url + "/v1/chat/completions", timeout=600, json={
            "model": MODEL, "max_tokens": 8, "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "user", "content": "Reverse a list."},
                         {"role": "assistant", "content": "def reverse(xs):"}]}).status_code
        rows.append(row)
        print(row, flush=True)
    finally:
        srv.stop()
    srv = Server(repo, python, {"--max-batch-size": 1}, help_text)
    try:
        first = {"stop": threading.Event()}
        holder = threading.Thread(target=read_stream, args=(srv.url, long_body(1900, True), first))
        holder.start()
        while not first.get("times"):
            time.sleep(0.01)
        with httpx.stream("POST", srv.url + "/v1/completions", json=long_body(8, True), timeout=600) as r:
            t0 = time.monotonic()
            line = next(x for x in r.iter_lines() if x)
            row = {"probe": "doors", "door": "queued stream", "first_line": line[:12],
                   "first_line_after_s": round(time.monotonic() - t0, 1)}
        first["stop"].set()
        holder.join(600)
        rows.append(row)
        print(row, flush=True)
    finally:
        srv.stop()
    port = free_port()
    proc = subprocess.Popen([python, "-m", "simsd.entrypoints.cli", "serve", "--port", str(port), "--api-key", "clé",
                             "--log-level", "warning"], cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    row = {"probe": "doors", "door": "non-ASCII --api-key"}
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        if proc.poll() is not None:
            row["start"] = f"exit {proc.returncode}: {proc.stderr.read().strip().splitlines()[-1]}"
        else:
            row["start"] = "served"
            row["the_key_as_utf8"] = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60, headers={
                "Authorization": "Bearer clé".encode()}).status_code
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    rows.append(row)
    print(row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=HERE)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--sizes", default="1,4,20")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--requests", type=int, default=120, help="(d) load: mixed requests per concurrency")
    ap.add_argument("--only", default="large,signals,codes,load")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    help_text = subprocess.run([a.python, "-m", "simsd.entrypoints.cli", "serve", "--help"], cwd=a.repo,
                               capture_output=True, text=True, check=True).stdout
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=a.repo, capture_output=True, text=True).stdout
    rows, only = [], a.only.split(",")
    sizes = [int(s) for s in a.sizes.split(",")]
    if "large" in only:
        rows += probe_large(a.repo, a.python, help_text, sizes, raise_limit=False)
        if "--max-request-bytes" in help_text:
            rows += probe_large(a.repo, a.python, help_text, [max(sizes)], raise_limit=True)
    if "signals" in only:
        for order in [("SIGTERM",), ("SIGTERM", "SIGTERM"), ("SIGTERM", "SIGINT"), ("SIGINT",), ("SIGINT", "SIGINT")]:
            rows.append(probe_signals(a.repo, a.python, help_text, order, a.in_flight, a.max_tokens))
    if "codes" in only:
        rows.append(probe_codes(a.repo, a.python, help_text))
    if "load" in only:
        rows.append(probe_load(a.repo, a.python, help_text, a.requests))
    if "doors" in only:
        rows += probe_doors(a.repo, a.python, help_text)
    if a.out:
        a.out.write_text(json.dumps({"git": git.strip(), "repo": str(a.repo), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
