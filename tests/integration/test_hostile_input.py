"""Hostile input against a served graph with an API key: every attack gets a 4xx in OpenAI's shape, fast, while
the ingress keeps answering a concurrent normal request within 2 s (8 s while it answers 300 connections at
once), a concurrent streamed reply never pauses for 1 s, and its memory stays bounded.

The app is the tiny Omni graph at ``/hostile`` with ``ingress.api_keys`` set and a short body timeout. Each
attack runs while a thread keeps sending authenticated ``GET /v1/models`` (a request through the ingress
replica's event loop), another streams chat replies one after another, and a third samples the ingress
replica's RSS. The planted shared-memory index file is in
``test_hostile_input_shm.py``.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from tests.integration.conftest import FIXED_TOPOLOGY

pytestmark = pytest.mark.integration

APP = "omni_hostile"
PREFIX = "/hostile"
KEY = "sk-hostile-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "qwen2.5-omni"
BODY_TIMEOUT_S = 3.0
MAX_PROBE_S = 2.0  # the concurrent normal request's bound, throughout every attack
MAX_STREAM_GAP_S = 1.0  # the longest gap between two events of a concurrent streamed reply, throughout
# Growth of the ingress replica's RSS over its level before the attacks, at any moment of any attack (each attack
# prints its peak; the last test prints them all).
MAX_RSS_GROWTH_MB = 250  # measured peaks on 2 cores: 4-97 MB (the oversized body's 32 MiB buffered, the highest)
STAGES = ("encoder", "thinker", "talker", "code2wav")


@pytest.fixture(scope="module")
def hostile(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, "ingress.num_cpus": 0, "ingress.api_keys": [KEY],
        "ingress.body_timeout_s": BODY_TIMEOUT_S, **{f"stages.{s}.num_cpus": 0 for s in STAGES},
        "stages.talker.params.max_codec_tokens": 8, "stages.code2wav.params.num_steps": 2,
        "stages.thinker.engine.ar.num_kv_blocks": 64,  # 1024 tokens per request, below the 4096 context
    }), name=APP, route_prefix=PREFIX)
    url = ray_serve + PREFIX
    # One streamed reply first: the first through a fresh graph pays its warm-up, which no attack should be
    # charged with (the watched stream's gap bound).
    warm = chat("count to twenty") | {"stream": True, "max_tokens": 24, "min_tokens": 24}
    assert httpx.post(url + "/v1/chat/completions", json=warm, headers=AUTH, timeout=60).status_code == 200
    pid = _ingress_pid()
    state = {"url": url, "pid": pid, "rss0": _rss_mb(pid), "peak": {}}
    yield state
    serve.delete(APP)


def _ingress_pid() -> int:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if any(f"ServeReplica:{APP}:ingress" in part for part in proc.info["cmdline"] or ()):
            return proc.pid
    raise AssertionError("no ingress replica process found")


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


@contextmanager
def watched(state: dict, attack: str, max_probe_s: float = MAX_PROBE_S):
    """While the block runs: authenticated /v1/models every 0.1 s (latencies), streamed chat replies one after
    another (the gaps between their events) and the ingress' RSS every 50 ms. ``max_probe_s`` bounds the probe
    (an attack that is itself hundreds of requests the proxy must answer puts the probe in their line)."""
    latencies, gaps, rss, errors, stop = [], [], [], [], threading.Event()

    def probe():
        with httpx.Client(base_url=state["url"], headers=AUTH, timeout=30) as c:
            while not stop.is_set():
                start = time.monotonic()
                status = c.get("/v1/models").status_code
                latencies.append(time.monotonic() - start)
                if status != 200:
                    errors.append(f"probe answered {status}")
                stop.wait(0.1)

    def stream():
        body = chat("count to twenty") | {"stream": True, "max_tokens": 24, "min_tokens": 24}
        with httpx.Client(base_url=state["url"], headers=AUTH, timeout=60) as c:
            while not stop.is_set():
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    last, data = None, None
                    for line in r.iter_lines():
                        now = time.monotonic()
                        if line.startswith("data:"):
                            if last is not None:
                                gaps.append(now - last)
                            last, data = now, line
                    if r.status_code != 200 or data != "data: [DONE]":
                        errors.append(f"stream answered {r.status_code}, last event {data!r}")

    def sample():
        while not stop.is_set():
            rss.append(_rss_mb(state["pid"]))
            stop.wait(0.05)

    def guarded(target):
        def run():
            try:
                target()
            except Exception as e:  # noqa: BLE001 - reported in the test's thread below
                errors.append(f"{target.__name__}: {e!r}")
        return threading.Thread(target=run)

    threads = [guarded(probe), guarded(stream), guarded(sample)]
    for t in threads:
        t.start()
    try:
        yield
        stop.wait(0.3)  # the probe runs a little past the attack's answer, too
    finally:
        stop.set()
        for t in threads:
            t.join()
    state["peak"][attack] = max(rss) - state["rss0"]
    print(f"\n{attack}: probe max {max(latencies) * 1000:.0f} ms over {len(latencies)}; stream gap max "
          f"{max(gaps, default=0) * 1000:.0f} ms over {len(gaps)}; RSS peak +{state['peak'][attack]:.0f} MB")
    assert not errors, (attack, errors)
    assert latencies and max(latencies) < max_probe_s, (attack, max(latencies))
    assert gaps and max(gaps) < MAX_STREAM_GAP_S, (attack, max(gaps))
    assert state["peak"][attack] < MAX_RSS_GROWTH_MB, (attack, state["peak"][attack])


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def chat(parts: list[dict] | str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}


def png_b64(width: int, height: int, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def image_part(b64: str, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}


def audio_part(samples: np.ndarray, rate: int, fmt: str = "FLAC") -> dict:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype="PCM_16")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                   "format": fmt.lower()}}


def bomb_png(side: int) -> str:
    """A small PNG whose header declares side x side pixels (a decompression bomb)."""
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def post(state, body: dict, headers=AUTH, timeout=60) -> httpx.Response:
    return httpx.post(state["url"] + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)


# -- authentication -------------------------------------------------------------------------------------------


def test_missing_and_wrong_keys_are_401_and_the_right_key_works(hostile):
    with watched(hostile, "keys"):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
            err = openai_error(post(hostile, chat("hi"), headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        openai_error(httpx.get(hostile["url"] + "/v1/models"), 401)
        openai_error(httpx.get(hostile["url"] + "/metrics"), 401)
        r = post(hostile, chat("hi"))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_the_openai_client_with_the_right_key_works_and_with_a_wrong_one_gets_401(hostile):
    import openai

    good = openai.OpenAI(base_url=hostile["url"] + "/v1", api_key=KEY, max_retries=0)
    reply = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.content is not None
    bad = openai.OpenAI(base_url=hostile["url"] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_health_tells_strangers_only_the_status_and_docs_are_off(hostile):
    stranger = httpx.get(hostile["url"] + "/health", timeout=30)
    assert stranger.status_code == 200 and stranger.json() == {"status": "ok"}
    insider = httpx.get(hostile["url"] + "/health", headers=AUTH, timeout=30).json()
    assert insider["status"] == "ok" and set(insider["stages"]) == set(STAGES) and "ingress" in insider
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(hostile["url"] + path, headers=AUTH).status_code == 404, path


# -- bodies ---------------------------------------------------------------------------------------------------


def test_an_oversized_body_is_413_from_its_header_and_while_streaming(hostile):
    big = b'{"model": "' + b"x" * (40 << 20) + b'"}'
    with watched(hostile, "oversized body"):
        r = httpx.post(hostile["url"] + "/v1/chat/completions", content=big, headers=AUTH, timeout=60)
        assert openai_error(r, 413)["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit is counted as the bytes arrive
            for i in range(0, len(big), 1 << 20):
                yield big[i:i + (1 << 20)]

        r = httpx.post(hostile["url"] + "/v1/chat/completions", content=chunks(), headers=AUTH, timeout=60)
        assert openai_error(r, 413)["code"] == "request_too_large"


def test_a_slow_body_is_408_after_the_body_timeout(hostile):
    host, port = httpx.URL(hostile["url"]).host, httpx.URL(hostile["url"]).port
    with watched(hostile, "slow body"):
        start = time.monotonic()
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall((f"POST {PREFIX}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                          f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                          "Content-Length: 100000\r\n\r\n").encode())
            reply = b""
            sock.settimeout(0.5)
            while b"\r\n\r\n" not in reply and time.monotonic() - start < BODY_TIMEOUT_S + 20:
                try:
                    sock.sendall(b" ")  # one byte at a time, for ever
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
                except (socket.timeout, TimeoutError):
                    continue
                except OSError:
                    break
        elapsed = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert BODY_TIMEOUT_S - 0.5 < elapsed < BODY_TIMEOUT_S + 10, elapsed


# -- media and prompts ----------------------------------------------------------------------------------------


def test_too_many_media_parts_is_a_400(hostile):
    tiny = png_b64(32, 32)
    with watched(hostile, "many parts"):
        err = openai_error(post(hostile, chat([image_part(tiny)] * 17 + [{"type": "text", "text": "?"}])), 400)
    assert "media parts" in err["message"] and err["param"] == "messages"


def test_high_rate_multichannel_audio_is_refused_from_its_header(hostile):
    loud = np.zeros((655350, 8), dtype=np.float32)  # 1 s, 8 channels at 655 kHz: ~1.2 MB of FLAC
    loud[::1000] = 0.1
    stereo_plus = np.zeros((48000, 3), dtype=np.float32)
    with watched(hostile, "multichannel audio"):
        start = time.monotonic()
        err = openai_error(post(hostile, chat([audio_part(loud, 655350)])), 400)
        assert "sample rate" in err["message"] and err["param"].endswith("input_audio.data")
        assert time.monotonic() - start < 2.0
        err = openai_error(post(hostile, chat([audio_part(stereo_plus, 48000, "WAV")])), 400)
        assert "3 channels" in err["message"]


def test_many_large_images_are_refused_from_their_headers(hostile):
    big = png_b64(4096, 4096)  # solid colour: ~50 KB each, 16.7 M pixels decoded
    with watched(hostile, "many large images"):
        err = openai_error(post(hostile, chat([image_part(big)] * 10 + [{"type": "text", "text": "?"}])), 400)
        assert "pixels in all" in err["message"] and err["param"] == "messages[0].content[1].image_url.url"
        err = openai_error(post(hostile, chat([image_part(bomb_png(30000))])), 400)
        assert "pixels" in err["message"]  # a decompression bomb: its header declares 900 M pixels
        err = openai_error(post(hostile, chat([image_part(png_b64(64, 64, "BMP"), "image/bmp")])), 400)
        assert "accepted format" in err["message"]  # formats the API does not document never reach a decoder


def test_a_huge_prompt_is_refused_before_tokenizing(hostile):
    with watched(hostile, "huge prompt"):
        start = time.monotonic()
        err = openai_error(post(hostile, chat("word " * 2_000_000)), 400)  # 10 MB
        assert time.monotonic() - start < 2.0
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]


def test_a_huge_image_prompt_is_refused_before_tokenizing(image_app):
    start = time.monotonic()
    r = httpx.post(image_app + "/v1/images/generations", json={"prompt": "cat " * 2_500_000}, timeout=60)
    assert time.monotonic() - start < 5.0
    err = openai_error(r, 400)
    assert err["param"] == "prompt" and "characters" in err["message"]


def test_after_the_attacks_a_normal_request_with_media_succeeds(hostile):
    r = post(hostile, chat([image_part(png_b64(32, 32)), {"type": "text", "text": "what is this?"}]))
    assert r.status_code == 200, r.text
    print(f"\ningress RSS before the attacks {hostile['rss0']:.0f} MB; peak growth per attack (MB): "
          + ", ".join(f"{k} {v:.0f}" for k, v in hostile["peak"].items()))


def test_a_million_content_parts_are_refused_before_parsing(hostile):
    many = json.dumps(chat([{"type": "text", "text": ""}] * 1_200_000), separators=(",", ":")).encode()
    some = json.dumps(chat([{"type": "text", "text": ""}] * 5000)).encode()  # within the brace bound
    assert len(many) < 32 << 20
    headers = {**AUTH, "Content-Type": "application/json"}
    with watched(hostile, "1.2 M content parts"):
        r = httpx.post(hostile["url"] + "/v1/chat/completions", content=many, headers=headers, timeout=60)
        err = openai_error(r, 400)
        assert err["code"] == "request_too_large" and "JSON objects" in err["message"]
        err = openai_error(httpx.post(hostile["url"] + "/v1/chat/completions", content=some, headers=headers,
                                      timeout=60), 400)
        assert "5000 content parts" in err["message"] and "limits.max_content_parts" in err["message"]


OPEN_PATHS = (("POST", "/health", 405), ("GET", "/health", 200), ("POST", "/nothing/here", 404),
              ("GET", "/v2/anything", 404))


def test_bodies_sent_to_paths_that_take_none_are_never_read(hostile):
    """300 unauthenticated clients each declare a 10 MB body, send 10 bytes of it and wait: every one is answered
    (200 from the cached /health, 405 or 404) without the ingress reading on; none waits for the body timeout
    (408), and the stages are not probed once per call."""
    host, port = httpx.URL(hostile["url"]).host, httpx.URL(hostile["url"]).port
    socks, replies = [], []
    # The 300 requests are answered, each through the proxy and the ingress replica: a probe sent among them waits
    # its turn (2.8 s seen once on CI's 2 cores). What this test guards against, an ingress that reads on or holds
    # a connection until the body timeout, shows as a 408 below; the probe only has to show the ingress answers.
    with watched(hostile, "300 trickled bodies", max_probe_s=4 * MAX_PROBE_S):
        try:
            for i in range(300):
                method, path, _ = OPEN_PATHS[i % len(OPEN_PATHS)]
                sock = socket.create_connection((host, port), timeout=30)
                socks.append(sock)
                sock.sendall((f"{method} {PREFIX}{path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                              "\r\nContent-Length: 10000000\r\n\r\n0123456789").encode())
            for sock in socks:
                reply = b""
                while b"\r\n\r\n" not in reply:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
                replies.append(reply)
        finally:
            for sock in socks:
                sock.close()
    for i, reply in enumerate(replies):
        method, path, status = OPEN_PATHS[i % len(OPEN_PATHS)]
        assert reply.startswith(f"HTTP/1.1 {status}".encode()), (method, path, reply[:200])


def test_an_unknown_path_s_404_names_no_route_and_no_model(hostile):
    err = openai_error(httpx.get(hostile["url"] + "/v1/secret/things", headers=AUTH), 404)
    assert "/v1/chat/completions" not in err["message"] and MODEL not in err["message"]
    assert "qwen" not in err["message"].lower()


def test_prompt_and_max_tokens_beyond_the_kv_cache_are_a_400(hostile):
    with watched(hostile, "KV capacity"):
        err = openai_error(post(hostile, chat("hi") | {"max_tokens": 2000}), 400)
    assert err["code"] == "context_length_exceeded" and "KV cache holds 1024 tokens" in err["message"]


def video_part(raw: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(raw).decode()}}


@pytest.fixture(scope="module")
def minute_1080p() -> bytes:
    """59 s of flat 1080p at 30 fps, H.264: ~100 KB, 3.7 G pixels to decode; within every per-video limit."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "51"}
        frame = av.VideoFrame(1920, 1080, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for i in range(59 * 30):
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def test_sixteen_minute_long_1080p_videos_are_refused_from_their_headers(hostile, minute_1080p):
    parts = [video_part(minute_1080p)] * 16 + [{"type": "text", "text": "?"}]
    with watched(hostile, "16 one-minute 1080p videos"):
        err = openai_error(post(hostile, chat(parts)), 400)
    assert "video.max_request_decoded_pixels" in err["message"] and err["param"].startswith("messages[0].content[")


def test_a_header_that_understates_the_frame_size_is_refused_while_decoding(hostile):
    from tests.unit.test_video_attacks import mp4

    liar = mp4([(64, 64, 5), (1920, 1080, 5)])
    with watched(hostile, "understated frame size"):
        err = openai_error(post(hostile, chat([video_part(liar), {"type": "text", "text": "?"}])), 400)
    assert "larger than the 64x64 the video's header declares" in err["message"]


def test_an_hls_playlist_is_refused_and_connects_nowhere(hostile):
    from tests.unit.test_video_attacks import Listener, playlist

    listener = Listener()
    with watched(hostile, "HLS playlist"):
        err = openai_error(post(hostile, chat([video_part(playlist(f"http://127.0.0.1:{listener.port}/a.ts")),
                                               {"type": "text", "text": "?"}])), 400)
    assert listener.close() == 0
    assert "must be in a container of" in err["message"]
