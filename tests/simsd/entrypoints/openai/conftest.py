"""The OpenAI-compatible server's test fixtures: ``llm``, an exact-mode LLM of the bundled pair
(float32, CPU, 4 rows; a module may override it), and ``url``, that LLM served in-process on
127.0.0.1 and a free port for the module's tests."""
import pytest


@pytest.fixture(scope="module")
def llm():
    from simsd import LLM
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=4)
    yield llm
    assert llm.shutdown(timeout=60)


@pytest.fixture(scope="module")
def url(llm):
    pytest.importorskip("fastapi")
    from simsd.entrypoints.openai.api_server import build_app
    from tests.simsd.entrypoints.serving import running_server
    with running_server(build_app(llm, shutdown_llm=False)) as url:
        yield url
