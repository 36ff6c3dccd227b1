"""Helpers for the API and server tests: single runs through the decoders, an in-process server."""
from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path

from simsd.decoding.config import DecodeConfig
from simsd.decoding.sampling import StepSampling
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.speculative import SpecConfig, SpeculativeDecoder

#: the bundled target's served name, the seconds a test request may take, a chat and a prompt of ids
NAME = "tiny-sdar-target"
TIMEOUT = 120
CHAT = [{"role": "user", "content": "Write a function that reverses a list."}]
IDS = [11, 12, 13, 14, 15]


def post(url: str, path: str, **body):
    """The httpx response of a POST of ``body`` (with ``model``: :data:`NAME`) to ``url + path``."""
    import httpx
    return httpx.post(url + path, json={"model": NAME, **body}, timeout=TIMEOUT)


def single(llm, ids, params, seed):
    """One prompt through the existing batch decoders (the CLI's code path), alone."""
    cfg = DecodeConfig(block_length=llm.block_length, strategy=params.strategy,
                       sampling=StepSampling(params.temperature, params.top_k, params.top_p),
                       max_new_tokens=params.max_tokens)
    if llm.mode == "vanilla":
        out = vanilla_generate_batch(llm.target.model, [ids], cfg, llm.target.mask_token_id, llm.target.stop_ids,
                                     seeds=[seed])
    else:
        dec = SpeculativeDecoder(llm.target, llm.draft, cfg, SpecConfig(mode=llm.mode))
        out = dec.generate_batch([ids], seeds=[seed])
    return out.results[0]


def single_text(llm, ids, params, seed=0) -> tuple:
    """``(text, token_ids)`` of a single run, the text as the API shows it."""
    ids_out = single(llm, ids, params, seed).token_ids
    stop = bool(ids_out) and ids_out[-1] in llm.target.stop_ids
    return llm.tokenizer.decode(ids_out[:-1] if stop else ids_out), ids_out


def doc_blocks(doc: str, heading: str, lang: str) -> list:
    """The ``lang`` code blocks of the section ``heading`` (a ``#`` heading of any level, up to the
    next heading of the same or a higher level) of ``doc`` (a path from the repository root, e.g.
    ``README.md`` or ``docs/api.md``): its examples, as written."""
    text = (Path(__file__).resolve().parents[3] / doc).read_text()
    m = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert m, f"{doc} has no section {heading!r}"
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, re.M)
    return re.findall(rf"```{lang}\n(.*?)```", rest[:end.start()] if end else rest, re.S)


def readme_blocks(heading: str, lang: str) -> list:
    """The ``lang`` code blocks of the README's section ``heading``: its examples, as written."""
    return doc_blocks("README.md", heading, lang)


def wait_for(cond, seconds: float = 60.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def running_server(app, seconds: float = 60.0):
    """Serve ``app`` with uvicorn on 127.0.0.1 and a free port in a thread; yields the base URL
    and stops the server (bounded waits) on exit."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started or not thread.is_alive(), seconds), "the server did not start"
        assert server.started, "the server thread ended before it started"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(seconds)
        assert not thread.is_alive(), "the server did not stop"


def stream_in_background(httpx, url: str, body: dict, seconds: float = TIMEOUT) -> tuple:
    """POST ``body`` (streamed) to ``url + "/v1/completions"`` on a thread; returns ``(thread,
    events)`` once the first server-sent event has arrived (``events``: each ``data:`` payload as it
    comes, then the ``repr`` of a transport error if the connection broke). Raises AssertionError
    when no event comes within ``seconds``."""
    events, started = [], threading.Event()

    def read():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=seconds) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        except httpx.TransportError as exc:
            events.append(repr(exc))
        finally:
            started.set()
    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(seconds) and events, "no event from the stream"
    return reader, events
