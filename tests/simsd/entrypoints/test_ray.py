"""Ray (docs/scaling.md): ``--ray`` without Ray is a one-line error naming the package;
Ray Data workers (``simsd generate/eval --ray --num-workers 2``) write what one process writes,
in the input order, with the same tokens for the same seeds; Ray Serve replicas (``simsd serve
--ray``) answer as one server does.

The tests that need Ray share one local instance (127.0.0.1, 2 CPUs, a bounded object store),
started and shut down by the module's fixture; they are skipped only where Ray is not installed
(CI installs the ``[ray]`` extra, so there they run)."""
import json
import sys

import pytest

from simsd.entrypoints.cli import main

#: the statistics that are timings (they differ from run to run); every other field must be equal
TIMINGS = ("decode_seconds", "tokens_per_second", "queue_seconds", "time_to_first_token")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=200 * 2 ** 20,
             log_to_driver=False, configure_logging=False)
    yield ray
    try:
        from ray import serve
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("argv,module", [(["generate", "--prompt", "Hi"], "ray.data"),
                                         (["eval", "--prompt-set", "bundled"], "ray.data"),
                                         (["serve"], "ray.serve")])
def test_ray_missing_is_one_line_naming_the_package(capsys, monkeypatch, argv, module):
    """Whatever is installed: ``ray`` (and its libraries) made unimportable."""
    for name in ("ray", "ray.data", "ray.serve"):
        monkeypatch.setitem(sys.modules, name, None)  # import -> ImportError
    code, out, err = run(capsys, *argv, "--ray")
    assert code == 2 and out == ""
    assert err == (f"simsd: error: --ray needs Ray's {module.split('.')[1]} library (ray is not installed): "
                   f"pip install 'simsd[ray]'\n")


@pytest.mark.parametrize("argv,line", [
    (["generate", "--num-workers", "2"], "--num-workers applies to Ray runs: add --ray"),
    (["serve", "--replicas", "2"], "--replicas applies to Ray runs: add --ray"),
    (["serve", "--ray", "--replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below --replicas 3"),
    (["generate", "--ray", "--tp", "2", "--device", "cpu"], "--tp 2 with --ray: a Ray worker or replica is one "
                                                             "process"),
    (["generate", "--ray", "--device", "cuda:1"], "--device cuda:1 with --ray: a Ray worker or replica sees the GPUs "
                                                  "Ray gives it as cuda:0 (one per distinct CUDA device named)"),
    (["serve", "--ray", "--mode", "exact", "--device", "cuda:0", "--draft-device", "cuda:2"],
     "--draft-device cuda:2 with --ray: a Ray worker or replica sees the GPUs Ray gives it as cuda:0 .. cuda:1"),
])
def test_ray_option_refusals(capsys, argv, line):
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith("simsd: error: ") and line in err, err


def without_timings(line: str) -> dict:
    row = json.loads(line)
    row["stats"] = {k: v for k, v in row["stats"].items() if k not in TIMINGS}
    return row


def test_ray_data_generate_equals_one_process(ray_instance, capsys, tmp_path):
    """5 prompts (text and ids) sampled in exact mode, chunks of 2 over 2 workers: the same JSON
    lines as one process, in the input order (prompt i's seed is --seed + i of the whole set)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"prompt": "Hello"}, {"prompt": "What is 2+2?", "id": "q2"}, {"prompt_ids": [5, 6, 7, 8]},
        {"prompt": "Tell me a story"}, {"prompt": "Why is the sky blue?"}]) + "\n")
    argv = ["generate", "--mode", "exact", "--prompts-file", str(prompts), "--json", "--max-tokens", "16",
            "--temperature", "0.8", "--seed", "11", "--batch-size", "2"]
    code, one, _ = run(capsys, *argv)
    assert code == 0
    code, fanned, _ = run(capsys, *argv, "--ray", "--num-workers", "2")
    assert code == 0
    one, fanned = one.splitlines(), fanned.splitlines()
    assert len(one) == 5 and [without_timings(x) for x in fanned] == [without_timings(x) for x in one]
    assert [json.loads(x)["id"] for x in fanned] == ["p.jsonl:1", "q2", "p.jsonl:3", "p.jsonl:4", "p.jsonl:5"]


def test_ray_data_eval_equals_one_process(ray_instance, capsys, tmp_path):
    """``simsd eval --ray``: every prompt's record (text, tokens, verdict, statistics but timings)
    in every mode equals one process's, in the set's order."""
    prompts = tmp_path / "e.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": f"What is {i}+{i}?", "answer": str(2 * i)})
                                 for i in range(3)) + "\n")
    argv = ["eval", "--prompts-file", str(prompts), "--modes", "vanilla,exact", "--max-tokens", "12", "--warmup", "0"]
    records = []
    for i, extra in enumerate(([], ["--ray", "--num-workers", "2", "--batch-size", "2"])):
        code, out, _ = run(capsys, *argv, "--json", str(tmp_path / f"r{i}.json"), *extra)
        assert code == 0 and "vanilla" in out and "exact" in out
        doc = json.loads((tmp_path / f"r{i}.json").read_text())
        for p in doc["prompts"]:
            for r in p["results"].values():
                r["stats"] = {k: v for k, v in r["stats"].items() if k not in TIMINGS + ("batch_size",)}
        records.append(doc["prompts"])
    assert [p["id"] for p in records[1]] == ["q0", "q1", "q2"]
    assert records[1] == records[0]


NAME = "tiny-sdar-target"
TIMEOUT = 180


@pytest.fixture(scope="module")
def one_server():
    """One ``simsd serve`` in this process (the reference): the bundled pair, exact mode."""
    pytest.importorskip("fastapi")
    from simsd import LLM
    from simsd.entrypoints.openai.api_server import build_app
    from tests.simsd.entrypoints.serving import running_server
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=4)
    with running_server(build_app(llm)) as url:
        yield url


@pytest.fixture(scope="module")
def replicas(ray_instance):
    """``simsd serve --ray --replicas 2`` on 127.0.0.1 (the same options as ``one_server``)."""
    from simsd.engine.tp import free_port
    from simsd.entrypoints.cli import parse
    from simsd.entrypoints.ray_serve import start
    args = parse(["serve", "--ray", "--replicas", "2", "--batch-size", "4", "--host", "127.0.0.1", "--port",
                  str(free_port()), "--device", "cpu", "--dtype", "float32"])
    return start(args)


def post(url, body) -> dict:
    import httpx
    r = httpx.post(f"{url}/v1/completions", json={"model": NAME, **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url, body) -> tuple:
    """``(the streamed text, the final choice's finish_reason and simsd extension)``."""
    import httpx
    text, last = "", None
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": NAME, **body, "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                if choice["finish_reason"] is not None:
                    last = (choice["finish_reason"], {k: v for k, v in choice["simsd"].items() if k != "stats"})
    return text, last


def answer(doc: dict) -> tuple:
    """What must be equal between servers: text, finish reason, stop reason, statistics but
    timings, token counts (the seed: where the request gives it, it is reported back as given)."""
    c = doc["choices"][0]
    stats = {k: v for k, v in c["simsd"]["stats"].items() if k not in TIMINGS + ("batch_size",)}
    return c["text"], c["finish_reason"], c["simsd"]["stop_reason"], stats, doc["usage"]


BODIES = [{"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "seed": 5},
          {"prompt": [11, 12, 13, 14], "max_tokens": 16},
          {"prompt": "def reverse(xs):", "max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "seed": 7}]


def test_ray_serve_answers_as_one_server(replicas, one_server):
    """Non-streaming and streaming completions through 2 replicas equal one server's."""
    for body in BODIES:
        want, got = post(one_server, body), post(replicas, body)
        assert answer(got) == answer(want)
        assert got["choices"][0]["simsd"]["seed"] == body.get("seed", got["choices"][0]["simsd"]["seed"])
        text, (finish, ext) = stream(replicas, body)
        assert (text, finish, ext["seed"]) == (want["choices"][0]["text"], want["choices"][0]["finish_reason"],
                                               body.get("seed", ext["seed"]))


def test_ray_serve_batch_invariance(replicas, one_server):
    """8 sampled requests at once over the replicas (rows shared with others): each equals its
    answer alone on one server."""
    from concurrent.futures import ThreadPoolExecutor
    bodies = [{"prompt": f"Question {i}: why?", "max_tokens": 16, "temperature": 0.9, "seed": 100 + i}
              for i in range(8)]
    alone = [answer(post(one_server, b)) for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: answer(post(replicas, b)), bodies))
    assert [a[:3] + a[4:] for a in together] == [a[:3] + a[4:] for a in alone]


def replica_metrics(ray_instance) -> dict:
    """``{replica id: LLM.metrics()}`` of both replicas (calls through the deployment handle until
    both have answered)."""
    from ray import serve

    from simsd.entrypoints.ray_serve import NAME as APP
    handle = serve.get_deployment_handle(APP, app_name=APP)
    seen = {}
    for _ in range(64):
        m = handle.metrics.remote().result(timeout_s=TIMEOUT)
        seen[m["replica"]] = m
        if len(seen) == 2:
            return seen
    raise AssertionError(f"64 calls reached {len(seen)} replica(s)")


def test_ray_serve_disconnect_cancels_in_the_replica(replicas, ray_instance):
    """A client that goes away mid-stream: its request is cancelled in the replica that runs it
    (its row freed, the cancelled count up by one), long before its 1500 tokens."""
    import httpx

    from tests.simsd.entrypoints.serving import wait_for
    before = replica_metrics(ray_instance)
    cancelled = lambda ms: sum(m["requests"]["cancelled"] for m in ms.values())  # noqa: E731
    body = {"model": NAME, "prompt": [11, 12, 13], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{replicas}/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines)[6:])["choices"][0]["text"] is not None
        assert sum(m["running"] for m in replica_metrics(ray_instance).values()) == 1
    # the client has gone
    assert wait_for(lambda: (lambda ms: sum(m["running"] for m in ms.values()) == 0
                             and cancelled(ms) == cancelled(before) + 1)(replica_metrics(ray_instance)), TIMEOUT)
    after = replica_metrics(ray_instance)
    made = sum(m["generation_tokens"] for m in after.values()) - sum(m["generation_tokens"] for m in before.values())
    assert made < 1500


def test_ray_serve_deployment_options():
    """``--replicas`` / ``--max-replicas`` reach Ray Serve as a fixed count or its autoscaling
    range, and a replica asks Ray for its CPU threads and one GPU per CUDA device it names
    (checked on the deployment's options; nothing is started)."""
    pytest.importorskip("ray.serve", reason="the [ray] extra is not installed")
    from simsd.config.engine import EngineArgs
    from simsd.entrypoints.cli import parse
    from simsd.entrypoints.ray_cluster import llm_resources
    from simsd.entrypoints.ray_serve import deployment
    fixed = deployment(parse(["serve", "--ray", "--replicas", "3", "--device", "cpu", "--threads", "2"]))
    d = fixed._bound_deployment  # (the deployment an application binds; Ray Serve's own attribute)
    assert d.num_replicas == 3 and d.ray_actor_options == {"num_cpus": 2, "num_gpus": 0}
    scaled = deployment(parse(["serve", "--ray", "--replicas", "1", "--max-replicas", "4", "--batch-size", "6",
                               "--device", "cpu"]))._bound_deployment._deployment_config.autoscaling_config
    assert (scaled.min_replicas, scaled.max_replicas, scaled.target_ongoing_requests) == (1, 4, 6)
    assert llm_resources(EngineArgs(device="cuda:0", draft_device="cuda:1")) == {"num_cpus": 1, "num_gpus": 2}
    assert llm_resources(EngineArgs(device="cuda:1", draft_device="cuda:1")) == {"num_cpus": 1, "num_gpus": 1}
    assert llm_resources(EngineArgs(mode="vanilla", device="cuda")) == {"num_cpus": 1, "num_gpus": 1}


def test_only_rays_per_run_notices_are_dropped():
    """The driver's log filter drops the two notices Ray logs on every run (token authentication
    on by default, progress bars off) and keeps everything else, the warning that token
    authentication is off among it."""
    import logging

    from simsd.entrypoints.ray_cluster import _Quiet

    def record(msg):
        return logging.LogRecord("ray", logging.WARNING, __file__, 1, msg, None, None)
    quiet = _Quiet()
    assert not quiet.filter(record("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=..."))
    assert not quiet.filter(record("Progress bars disabled. To enable, set ..."))
    assert quiet.filter(record("Token authentication is disabled for this Ray cluster. Anyone with network access..."))
    assert quiet.filter(record("Progress bars for operators disabled."))
    assert quiet.filter(record("a worker died"))
