"""``omni-serve serve --api-key-file`` as a user runs it: its own local Ray with Ray's default token
authentication (the CLI no longer turns it off), the key required on the API, the official client working with
it, the key in no process' command line, and SIGTERM stopping Serve, the CLI and its Ray."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.integration.http_waits import wait_for_200

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = os.path.dirname(sys.executable)
PORT = 8013
URL = f"http://127.0.0.1:{PORT}"
KEY = "sk-cli-test"


@pytest.fixture(scope="module")
def served(qwen_image_tiny_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "OMNI_SERVE_API_KEY")}
    # HOME: Ray writes its token under ~/.ray; RAY_ADDRESS=local: a cluster of its own, whatever else runs here
    env.update(HOME=str(home), RAY_ADDRESS="local")
    (home / "keys").write_text(f"# the API's keys\n{KEY}\n")
    log = open(home / "serve.log", "w")
    proc = subprocess.Popen(
        [f"{BIN}/omni-serve", "serve", "--graph", "qwen_image", "--port", str(PORT), "--num-cpus", "2",
         "--api-key-file", str(home / "keys"), f"checkpoint={qwen_image_tiny_dir}", "default_size=64x64", "default_steps=2"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_200(f"{URL}/health", 300, f"omni-serve serve did not come up (log: {home / 'serve.log'})",
                     alive=lambda: proc.poll() is None)
        yield SimpleNamespace(home=home, proc=proc)
    finally:
        # SIGTERM to the CLI alone, as a supervisor stops it: it shuts Serve and its Ray down (~9 s). SIGTERM to the
        # whole group would kill Ray's GCS under it, and Serve's shutdown would then wait 30 s for a controller it
        # can no longer reach. Whatever is left after it exits (or if it does not) is killed.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_the_cli_keeps_rays_token_authentication_on(served):
    token = served.home / ".ray" / "auth_token"
    assert token.is_file() and token.read_text().strip(), "Ray started without token authentication"
    assert "Token authentication is enabled" in (served.home / "serve.log").read_text()


def test_the_api_key_is_required_and_the_openai_client_uses_it(served):
    import openai

    r = httpx.post(f"{URL}/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{URL}/health", timeout=30).json() == {"status": "ok"}
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key=KEY, max_retries=0)
    result = client.images.generate(model="qwen-image", prompt="a small blue bird", size="64x64",
                                    response_format="b64_json", extra_body={"seed": 1})
    assert len(result.data) == 1 and result.data[0].b64_json
    wrong = openai.OpenAI(base_url=f"{URL}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.images.generate(model="qwen-image", prompt="a cat", size="64x64", response_format="b64_json")


def test_the_key_is_in_no_command_line(served):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        assert KEY.encode() not in cmdline, f"pid {pid} shows the API key: {cmdline!r}"


def test_sigterm_stops_the_cli_and_every_process_of_its_ray(served):
    """What a supervisor does (SIGTERM to the process it started): Serve and the CLI's own Ray shut down, soon."""
    start = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=60) == 0
    took = time.monotonic() - start
    log = (served.home / "serve.log").read_text()
    assert "shutting down" in log and "failed to shut down" not in log, log[-2000:]
    with pytest.raises(ProcessLookupError):  # nothing of the group it led is left
        os.killpg(served.proc.pid, 0)
    print(f"stopped in {took:.1f} s")


def test_a_key_on_the_command_line_is_refused():
    proc = subprocess.run([f"{BIN}/omni-serve", "serve", "--api-key", "sk-visible"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--api-key-file" in proc.stderr, proc.stderr
