"""``simsd serve`` shutting down, in every order of signals (issue 26, item 2), on a real process
with the bundled pair: while the requests in flight drain, new ones get a 503 (OpenAI's body,
``Retry-After``) and ``/health`` a 503; at ``--shutdown-timeout`` (one signal) or at a second
signal, the requests still in flight, running or waiting, are cancelled (a 503; a stream: an
error chunk, then ``[DONE]``); the process exits 0 with every engine request cancelled and no
traceback. Times are bounded generously only: each in-flight request asks for 1900 tokens
(minutes here, 10 s or more on any CPU), and a two-signal run has a 600 s timeout, so a
cancellation can only come from the deadline or the second signal."""
import json
import signal
import threading
import time

import pytest

from tests.simsd.entrypoints.test_serve_cli import TIMEOUT, serve_process, wait_healthy

ORDERS = [("SIGTERM",), ("SIGTERM", "SIGTERM"), ("SIGTERM", "SIGINT"), ("SIGINT",), ("SIGINT", "SIGINT")]
LONG = {"model": "tiny-sdar-target", "prompt": [11, 12, 13], "max_tokens": 1900, "ignore_eos": True}


def stream(httpx, url, events, started):
    with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def post(httpx, url, answers):
    r = httpx.post(url + "/v1/completions", json=LONG, timeout=TIMEOUT)
    answers.append((r.status_code, r.json(), r.headers.get("retry-after")))


@pytest.mark.parametrize("order", ORDERS, ids="+".join)
def test_shutdown_in_every_order_of_signals(order):
    httpx = pytest.importorskip("httpx")
    timeout = 3 if len(order) == 1 else 600
    with serve_process("--shutdown-timeout", str(timeout)) as (proc, url):
        wait_healthy(httpx, proc, url)
        events, started, answers = [], threading.Event(), []
        clients = [threading.Thread(target=stream, args=(httpx, url, events, started))]
        clients[0].start()
        assert started.wait(TIMEOUT)  # the stream holds a row and has sent text
        clients += [threading.Thread(target=post, args=(httpx, url, answers)) for _ in range(2)]
        for c in clients[1:]:
            c.start()
        end = time.monotonic() + TIMEOUT  # two running, one waiting for a row
        while (h := httpx.get(url + "/health", timeout=TIMEOUT).json())["running"] + h["waiting"] < 3:
            assert time.monotonic() < end, h
            time.sleep(0.05)
        proc.send_signal(getattr(signal, order[0]))
        end = time.monotonic() + TIMEOUT
        while httpx.get(url + "/health", timeout=TIMEOUT).status_code != 503:  # the drain has begun
            assert time.monotonic() < end
            time.sleep(0.02)
        late = httpx.post(url + "/v1/completions", json=LONG, timeout=TIMEOUT)  # the listener still answers
        assert late.status_code == 503 and late.headers["retry-after"].isdigit()
        assert late.json()["error"]["message"] == "the server is shutting down"
        if len(order) == 2:
            proc.send_signal(getattr(signal, order[1]))
        for c in clients:
            c.join(TIMEOUT)
            assert not c.is_alive()
        answered = time.monotonic()
        code = proc.wait(60)
        err = proc.stderr.read()
        assert code == 0, err
        # the process ends soon after the last answer (about 0.2 s measured; generous here)
        assert time.monotonic() - answered < 60
        why = f"{timeout} s (simsd serve --shutdown-timeout)" if len(order) == 1 else f"({order[1]})"
        for status, body, retry in answers:
            assert status == 503 and retry.isdigit() and body["error"]["code"] == "shutting_down", body
            assert why in body["error"]["message"]
        assert events[-1] == "[DONE]" and why in json.loads(events[-2])["error"]["message"]
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # text came before the error
        # every engine request was cancelled, none decoded for nobody; no asyncio noise
        assert "(0 requests finished, 3 cancelled, 0 failed)" in err, err
        assert "Traceback" not in err and "Event loop is closed" not in err, err
