"""bench/probe_server.py stays runnable: its status-code probe against this checkout's
``simsd serve`` gives issue 26's answers (the large-request and signal probes take minutes and
are covered by tests/simsd/entrypoints/test_serve_shutdown.py's matrix and the recorded rows)."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "probe_server.py"


def test_the_status_code_probe(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    spec = importlib.util.spec_from_file_location("probe_server", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = tmp_path / "rows.json"
    assert probe.main(["--only", "codes", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row == {"probe": "codes", "dropped": [], "wrong_key": 401, "cors_preflight": 200,
                   "100_prompts_8_rows": 400, "null_fields": 200}
