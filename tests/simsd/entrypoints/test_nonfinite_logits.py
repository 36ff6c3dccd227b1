"""Non-finite logits fail their request (issue 26, item 6): a NaN's argmax is token 0, often a
stop id, so decoding them would end in silent garbage. Forced two ways: a checkpoint whose
logits overflow float16 (finite in float32 and bfloat16), and a scripted forward that poisons
one row's logits; in every mode, for the target and the draft, through the API, the command
line and the server."""
import pytest

from simsd import LLM, RequestError, SamplingParams
from simsd.engine.batching import NonFiniteLogits
from simsd.entrypoints.cli import main
from simsd.models.model import SDARForCausalLM
from tests.helpers import float16_overflow_checkpoint, random_checkpoint

CASES = [("vanilla", "target", {}), ("exact", "target", {}), ("exact", "draft", {}), ("paper", "target", {}),
         ("paper", "draft", {}), ("exact", "draft", {"optimistic": True}), ("exact", "target", {"optimistic": True})]


def models_for(role: str, mode: str):
    """``(target, draft)`` paths: the overflowing checkpoint in ``role``, a plain random one elsewhere."""
    plain, bad = random_checkpoint("nonfinite-plain"), float16_overflow_checkpoint()
    target = bad if role == "target" else plain
    return target, (None if mode == "vanilla" else bad if role == "draft" else plain)


def cause_of(info) -> NonFiniteLogits:
    exc = info.value.__cause__
    assert isinstance(exc, NonFiniteLogits), repr(info.value)
    return exc


@pytest.mark.parametrize("mode,role,extra", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_float16_overflow_fails_the_request_naming_model_dtype_and_step(mode, role, extra, temperature):
    target, draft = models_for(role, mode)
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=3)
    llm = LLM(target, draft, mode, dtype="float16", device="cpu", batch_size=1, **extra)
    try:
        with pytest.raises(RequestError) as info:
            llm.generate(["def add(a, b):"], params)
        exc = cause_of(info)
        assert (exc.model, exc.dtype, exc.block, exc.step) == (role, "float16", 0, 0)
        assert "bfloat16" in str(exc) and f"the {role} model (float16)" in str(exc)
    finally:
        assert llm.shutdown(timeout=60)
    for dtype in ("float32", "bfloat16"):  # the same checkpoint decodes in float32's range
        llm = LLM(target, draft, mode, dtype=dtype, device="cpu", batch_size=1, **extra)
        out = llm.generate(["def add(a, b):"], params)[0]
        assert llm.shutdown(timeout=60)
        assert out.token_ids, (dtype, out)


@pytest.fixture(scope="module")
def pair():
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=2)
    yield llm
    assert llm.shutdown(timeout=60)


MARK = 77  # only the poisoned prompt holds this id


@pytest.fixture
def poison(monkeypatch):
    """``poison["model"] = model``: from then on, the logits of every row of ``model`` whose
    forward input holds :data:`MARK` are NaN at one position (``poison["at"]`` of the returned
    positions, default the first; a scripted forward wrapped around the model's own);
    ``poison["model"] = None`` turns it off."""
    state = {"model": None, "at": 0}
    real = SDARForCausalLM.forward

    def forward(model, ids, *args, **kwargs):
        logits = real(model, ids, *args, **kwargs)
        if logits is not None and state["model"] is not None and model is state["model"]:
            for r in range(ids.shape[0]):
                if bool((ids[r] == MARK).any()):
                    logits[r, state["at"], 5] = float("nan")
        return logits
    monkeypatch.setattr(SDARForCausalLM, "forward", forward)
    return state


@pytest.mark.parametrize("mode,role", [("vanilla", "target"), ("exact", "target"), ("exact", "draft"),
                                       ("paper", "target"), ("paper", "draft")])
def test_a_scripted_nan_fails_only_its_row_and_the_row_is_clean_afterwards(pair, poison, mode, role):
    llm = pair if mode == "exact" else LLM(pair.target, None if mode == "vanilla" else pair.draft, mode, batch_size=2)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    clean = [11, 12, 13]
    want = llm.generate([clean], params)[0].token_ids  # alone
    poison["model"] = (llm.target if role == "target" else llm.draft).model
    bad, good = llm.submit([11, 12, MARK], params), llm.submit(clean, params)
    with pytest.raises(RequestError) as info:
        bad.result(timeout=120)
    exc = cause_of(info)
    assert (exc.model, exc.dtype, exc.block) == (role, "float32", 0)
    assert "bfloat16" not in str(exc)  # the hint is float16's only
    assert good.result(timeout=120).token_ids == want  # its neighbour decodes as alone
    poison["model"] = None
    assert llm.generate([[11, 12, MARK]], params)[0].token_ids  # the freed row's flag was cleared
    if llm is not pair:
        assert llm.shutdown(timeout=60)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_command_line_exits_1_naming_the_model_dtype_and_step(capsys, role):
    target, draft = models_for(role, "exact")
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
            "--max-new-tokens", "8", "--mode", "exact"]
    assert main(argv + ["--dtype", "float16"]) == 1
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("simsd: error: "))
    path = target if role == "target" else draft
    assert f"the {role} model (float16)" in line and "step 0" in line and "bfloat16" in line and str(path) in line
    assert "Traceback" not in err
    assert main(argv + ["--dtype", "bfloat16"]) == 0


def test_the_server_answers_an_error_for_the_request(capsys):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from simsd.entrypoints.openai.api_server import build_app
    from tests.simsd.entrypoints.serving import running_server
    llm = LLM(float16_overflow_checkpoint(), mode="vanilla", dtype="float16", device="cpu", batch_size=1)
    with running_server(build_app(llm, shutdown_llm=True)) as url, httpx.Client(base_url=url, timeout=120) as h:
        name = h.get("/v1/models").json()["data"][0]["id"]
        r = h.post("/v1/completions", json={"model": name, "prompt": "def add(a, b):", "max_tokens": 8})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "target model (float16) gave non-finite logits" in r.json()["error"]["message"]
        assert h.get("/health").status_code == 200
        # not retryable (the same request fails the same way): the openai client, which retries a 500
        # twice by default, sends it once (issue 34 item 12)
        assert r.headers["x-should-retry"] == "false"
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, timeout=120)
        failed = llm.metrics()["requests"]["error"]
        with pytest.raises(openai.InternalServerError, match="non-finite logits"):
            client.completions.create(model=name, prompt="def add(a, b):", max_tokens=8)
        assert llm.metrics()["requests"]["error"] == failed + 1


def test_a_nan_at_the_last_requested_position_is_seen(pair, poison):
    """Every position a request asked logits for is looked at, the last one too (vanilla and exact:
    the denoise forward's block and the verify forward's copies)."""
    params = SamplingParams(max_tokens=8)
    poison["model"], poison["at"] = pair.target.model, -1
    for mode in ("vanilla", "exact"):
        llm = pair if mode == "exact" else LLM(pair.target, None, "vanilla", batch_size=2)
        with pytest.raises(RequestError) as info:
            llm.generate([[11, 12, MARK]], params)
        assert cause_of(info).model == "target"
        if llm is not pair:
            assert llm.shutdown(timeout=60)
