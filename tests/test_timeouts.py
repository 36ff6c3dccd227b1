"""A hang is a failure: the suite runs under pytest-timeout with a per-test limit."""
import subprocess
import sys


def test_suite_has_a_per_test_timeout(request):
    assert request.config.pluginmanager.hasplugin("timeout"), \
        "pytest-timeout is not installed: pip install -e '.[test]'"
    assert 0 < float(request.config.getini("timeout")) <= 600


def test_a_hanging_test_fails(tmp_path):
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hang():\n    while True:\n"
                                           "        time.sleep(0.05)\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2",
                          str(tmp_path / "test_hang.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 1 and "Timeout" in res.stdout, res.stdout[-2000:]
