"""Hostile input: requests generated from the served OpenAPI schema (schemathesis) against seven served graphs.

Every operation of the ingress's ``/openapi.json`` (the Omni graphs': chat, speech, transcriptions; Wan's video
job routes: create, retrieve, list, content, delete; Qwen3-ASR's transcriptions; VibeVoice's speech and voices
routes) is fuzzed
with schema-valid (positive) and schema-violating (negative) requests, a few thousand in all. Half of the bodies
that name a model are pointed at the served one, so generation runs deep into the stages (media decoding, the
thinker, talker and code2wav, the DiT and VAE, a video job's run) instead of stopping at ``model_not_found``. The
graphs run with small limits (short outputs, small images, few steps) so a valid request is cheap; the limits
themselves are fuzzed too.

Passes when: no answer is a 5xx; every 4xx carries an OpenAI error body; every stream ends in ``[DONE]`` (chat)
or a ``*.done`` event (speech, transcriptions) and carries no server error event; no replica of any graph
crashed or was replaced; generations succeeded; and afterwards every graph holds no request state.

Every graph's runs (its positive and its negative one) go at once, each a client process of its own, so the
graphs are fuzzed side by side on the shared cores (``_Runs`` says why), in two waves (``WAVES``).

``OMNI_SERVE_FUZZ_EXAMPLES`` (per graph and generation mode, default 800) and ``OMNI_SERVE_FUZZ_SEED``
(default 0; runs are reproducible) tune a run; failures print a curl command that reproduces each. GLM-Image gets
half as many positive examples: its ingress and request schema are the image kit's, fuzzed in full on Qwen-Image,
and each of its deep requests writes 257 AR tokens (about 0.7 s served, several times a Qwen-Image request); about
150 of its 400 positive examples still run deep into its stages. Its negative examples stay at the full count
(they stop at validation). Wan's positive run is half as long too: its create route answers at once (the job runs
after it) and a key's queue holds few jobs, so most of a long run would be 429s; the jobs it did create run
after the fuzz, and the graph must be idle once they ended. Qwen3-ASR's positive run is half as long: its one
route's schema is the Omni graphs' (fuzzed in full there), and a generated file is rarely audio. So is
VibeVoice's (its speech route's schema is the Omni graphs'; each deep request speaks 3 tokens).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from tests.integration.http_waits import busy_stages
from tests.integration.conftest import FIXED_TOPOLOGY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = int(os.environ.get("OMNI_SERVE_FUZZ_EXAMPLES", "800"))
POSITIVE_SHARE = {"fuzz_glm": 0.5, "fuzz_wan": 0.5, "fuzz_asr": 0.5, "fuzz_vibevoice": 0.5}  # of EXAMPLES, for the positive run (see the module's docstring)
SEED = int(os.environ.get("OMNI_SERVE_FUZZ_SEED", "0"))
OMNI_STAGES = ("encoder", "thinker", "talker", "code2wav")
IMAGE_STAGES = ("text_encoder", "dit", "vae")
GLM_STAGES = ("ar", "text_encoder", "dit", "vae")
WAN_STAGES = ("text_encoder", "dit", "vae")
ASR_STAGES = ("encoder", "llm")
VOICES = {"vibevoice": "alice"}  # a voice each speaking model knows (the Omni graphs': Chelsie)


APPS = ("fuzz_omni", "fuzz_qwen3", "fuzz_image", "fuzz_glm", "fuzz_wan", "fuzz_asr", "fuzz_vibevoice")


def _selected(request) -> list[str]:
    """The graphs whose test this session runs (all of them unless ``-k`` chose fewer)."""
    chosen = {item.callspec.params.get("app") for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    return [app for app in APPS if app in chosen]


@pytest.fixture(scope="module")
def fuzz_apps(request, ray_serve, omni_tiny_dir, qwen_image_tiny_dir, qwen3_omni_tiny_dir, glm_image_tiny_dir,
              wan_tiny_dir, qwen3_asr_tiny_dir, vibevoice_tiny_dir, tmp_path_factory):
    """The selected graphs with small limits, deployed and fuzzed wave by wave (``WAVES``): app -> (base URL, model,
    route, stages, positive examples, start: () -> (its replicas before the fuzz, its runs' futures))."""
    from omni_serve.families import glm_image, qwen2_5_omni, qwen3_asr, qwen3_omni, qwen_image, vibevoice, wan

    selected = _selected(request)

    omni_args = {
        "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in OMNI_STAGES},
        "stages.thinker.params.max_model_len": 512, "stages.thinker.params.default_max_tokens": 8,
        "stages.talker.params.max_codec_tokens": 16, "max_audio_seconds": 5, "max_image_pixels": 128 * 128,
        "ingress.request_timeout_s": 60, "ingress.enable_docs": True,  # the fuzzer reads /openapi.json
    }
    image_args = {  # both image graphs: small sizes and few steps
        "ingress.num_cpus": 0, "stages.dit.engine.torch_threads": 1, "default_size": "32x32", "default_steps": 2,
        "max_steps": 3, "max_side": 64, "max_pixels": 64 * 64, "max_images": 2, "ingress.request_timeout_s": 60,
        "ingress.enable_docs": True,
    }
    builds = {
        "fuzz_omni": lambda: qwen2_5_omni.build_app({"checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, **omni_args,
                                                     "stages.code2wav.params.num_steps": 1}),
        "fuzz_qwen3": lambda: qwen3_omni.build_app({"checkpoint": qwen3_omni_tiny_dir, **omni_args}),
        "fuzz_image": lambda: qwen_image.build_app({
            "checkpoint": qwen_image_tiny_dir, **{f"stages.{s}.num_cpus": 0 for s in IMAGE_STAGES}, **image_args}),
        "fuzz_glm": lambda: glm_image.build_app({
            "checkpoint": glm_image_tiny_dir, **{f"stages.{s}.num_cpus": 0 for s in GLM_STAGES}, **image_args}),
        "fuzz_wan": lambda: wan.build_app({  # small videos, few steps, a short queue per key
            "checkpoint": wan_tiny_dir, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in WAN_STAGES},
            "stages.dit.engine.torch_threads": 1, "default_size": "16x16", "default_seconds": 1, "default_fps": 4,
            "default_steps": 2, "max_steps": 3, "max_frames": 9, "max_side": 32, "max_pixels": 32 * 32,
            "max_running_jobs": 2, "jobs.max_queued_per_key": 4, "jobs.dir": str(tmp_path_factory.mktemp("fuzz_jobs")),
            "ingress.request_timeout_s": 60, "ingress.enable_docs": True}),
        "fuzz_asr": lambda: qwen3_asr.build_app({  # short windows and transcripts
            "checkpoint": qwen3_asr_tiny_dir, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in ASR_STAGES},
            "max_tokens": 8, "max_audio_seconds": 10, "window_seconds": 4, "window_search_seconds": 1,
            "max_file_bytes": 500_000, "ingress.request_timeout_s": 60, "ingress.enable_docs": True}),
        "fuzz_vibevoice": lambda: vibevoice.build_app({  # 3 speech tokens a request, a voice database of its own
            "checkpoint": vibevoice_tiny_dir, "stages.lm.num_cpus": 0, "ingress.num_cpus": 0,
            "stages.lm.engine.torch_threads": 1, "max_speech_seconds": 0.4, "max_voice_seconds": 5,
            "voices.dir": str(tmp_path_factory.mktemp("fuzz_voices")), "ingress.request_timeout_s": 60,
            "ingress.enable_docs": True}),
    }
    served = {"fuzz_omni": ("qwen2.5-omni", "/v1/chat/completions", OMNI_STAGES),
              "fuzz_qwen3": ("qwen3-omni", "/v1/chat/completions", OMNI_STAGES),
              "fuzz_image": ("qwen-image", "/v1/images/generations", IMAGE_STAGES),
              "fuzz_glm": ("glm-image", "/v1/images/generations", GLM_STAGES),
              "fuzz_wan": ("wan2.1-t2v", "/v1/videos", WAN_STAGES),
              "fuzz_asr": ("qwen3-asr", "/v1/audio/transcriptions", ASR_STAGES),
              "fuzz_vibevoice": ("vibevoice", "/v1/audio/speech", ("lm",))}
    with _Runs() as runs:
        waves = _Waves(runs, builds)
        try:
            apps = {}
            for app in selected:
                model, route, stages = served[app]
                positive = max(1, int(EXAMPLES * POSITIVE_SHARE.get(app, 1.0)))
                waves.add(app, ray_serve + f"/{app}", model, route, positive, EXAMPLES)
                apps[app] = (ray_serve + f"/{app}", model, route, stages, positive, lambda app=app: waves.start(app))
            yield apps
        finally:
            waves.delete()


def _replicas(app: str) -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#")}


def _openai_error(response) -> dict | None:
    """The ``error`` object of an OpenAI error body, or None when the body is not one."""
    try:
        error = response.json()["error"]
    except Exception:  # noqa: BLE001 - not JSON, not an object, no "error"
        return None
    ok = isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"] \
        and isinstance(error.get("type"), str)
    return error if ok else None


def _problem(response) -> str | None:
    """What is wrong with one answer, or None."""
    status = response.status_code
    if status >= 500:
        return f"{status}: {response.text[:300]}"
    if status >= 400:
        if _openai_error(response) is None:
            return f"{status} without an OpenAI error body: {response.text[:300]}"
        return None
    content_type = " ".join(response.headers.get("content-type", []))  # schemathesis: name -> [values]
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        # schemathesis stops reading a stream after its max_stream_events (and disconnects): what it read must be
        # sound, but the [DONE] it did not wait for cannot be asked of the server
        cut_short = getattr(response, "stream_cut_short", False)
        # chat streams end in [DONE]; the audio routes' (OpenAI's shape) in a "*.done" event
        done = bool(events) and (events[-1] == "[DONE]" or str(_event_type(events[-1])).endswith(".done"))
        if not done and not cut_short:
            return f"stream did not end in [DONE] or a done event: {events[-2:]}"
        for event in (events if events[-1] != "[DONE]" else events[:-1]):
            error = json.loads(event).get("error")
            if error is not None and error.get("type") not in ("invalid_request_error", "timeout_error"):
                return f"stream error event: {event[:300]}"
    return None


def _event_type(event: str):
    try:
        return json.loads(event).get("type")
    except (ValueError, AttributeError):
        return None


def _aim(body: dict, model: str, multipart: bool = False) -> None:
    """Point a generated body at what the graph serves, so it runs deep into the stages instead of stopping
    at the model, ``n`` or voice checks (every other field stays as generated)."""
    if "model" in body:
        body["model"] = model
    if "n" in body:
        body["n"] = 1
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = 0
    if isinstance(body.get("audio"), dict) and "voice" in body["audio"]:
        body["audio"]["voice"] = "Chelsie"
    if isinstance(body.get("voice"), str):  # /v1/audio/speech
        body["voice"] = VOICES.get(model, "Chelsie")
        body.pop("voice_reference", None)  # a generated clip is rarely audio, and names no one's voice
        body.pop("speaker_voices", None)
    if "file" in body and multipart:  # /v1/audio/transcriptions: a generated file is rarely audio
        body["file"] = _AIM_WAV


def _wav(seconds: float) -> bytes:
    import io

    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * 16000)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


_AIM_WAV = _wav(0.7)


class _Runs:
    """Fuzz runs, each a process of its own (a single-worker pool each: one client that dies fails only its own
    graph's test), all in flight at once: every selected graph's positive and negative run start together, so the
    graphs meet eight hostile clients at once and their engines batch the runs' generations. One run at a time left
    part of the two cores idle, each client waiting on its answers one at a time. Processes, not threads: on CPython
    3.11, ``compile`` in two threads at once (Hypothesis and schemathesis parse source as they go) can fail with "AST
    constructor recursion depth mismatch". A run that outlasts ``RUN_TIMEOUT_S`` fails its test and its process is
    killed, so a stuck client cannot hang the session."""

    def __enter__(self):
        self.pools = []
        return self

    def __exit__(self, *exc):
        for pool in self.pools:
            _kill(pool)

    def start(self, base_url: str, model: str, route: str, positive: int, negative: int) -> list:
        """``positive`` schema-valid and ``negative`` schema-violating cases, about half of them on the graph's
        own ``route`` and the rest on any operation: the two runs' futures."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        futures = []
        for mode, examples in (("positive", positive), ("negative", negative)):
            pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self.pools.append(pool)
            futures.append(pool.submit(_fuzz_mode, mode, base_url, model, route, examples))
        return futures


# Graphs fuzzed together: a wave's graphs are deployed and their runs start at once, once the wave before has ended
# (and its graphs were deleted). Seven graphs at once were too many for two cores and 24 GiB: fourteen hostile clients
# made the data directory miss /health's 3 s deadline (a 503), and ~30 replicas beside the session's own graphs
# crowded the memory; ten clients (the first wave) are not too many.
WAVES = (("fuzz_omni", "fuzz_qwen3", "fuzz_image", "fuzz_glm", "fuzz_wan"), ("fuzz_asr", "fuzz_vibevoice"))


class _Waves:
    """Deploys each app's wave and starts its runs when its first test asks (the tests run in ``APPS`` order), after
    every run of the waves before has ended and their graphs were deleted."""

    def __init__(self, runs: _Runs, builds: dict):
        self.runs, self.builds, self.args, self.started, self.deployed = runs, builds, {}, {}, []

    def add(self, app: str, *args) -> None:
        self.args[app] = args

    def start(self, app: str) -> tuple[set[str], list]:
        """(the app's replicas before its fuzz, its runs' futures)."""
        from concurrent.futures import wait

        from ray import serve

        if app not in self.started:
            wait([f for _, futures in self.started.values() for f in futures], timeout=RUN_TIMEOUT_S)
            self.delete()
            wave = [a for a in next(w for w in WAVES if app in w) if a in self.args]
            for other in wave:  # one after the other: all at once (serve.run_many) took longer, the cores are busy
                serve.run(self.builds[other](), name=other, route_prefix=f"/{other}")
                self.deployed.append(other)
            before = {other: _replicas(other) for other in wave}  # before any fuzz starts
            for other in wave:
                self.started[other] = (before[other], self.runs.start(*self.args[other]))
        return self.started[app]

    def delete(self) -> None:
        from ray import serve

        for app in self.deployed:
            serve.delete(app)
        self.deployed = []


def _kill(pool) -> None:
    """Stop ``pool``'s worker whatever it is doing (``ProcessPoolExecutor`` has no public way before Python 3.14's
    ``terminate_workers``), then shut the pool down."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        if process.is_alive():
            process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


# The longest a run may take: the slowest (GLM's, four graphs at once) took a few minutes on two cores.
RUN_TIMEOUT_S = max(900.0, 1.5 * EXAMPLES)


def _collect(runs: list) -> tuple[Counter, list[str], float]:
    """The runs' status counts per operation, problems with a curl command each, and the longest run's seconds."""
    statuses, codes, problems, took = Counter(), Counter(), [], 0.0
    for run in runs:
        run_statuses, run_codes, run_problems, seconds = run.result(timeout=RUN_TIMEOUT_S)
        statuses.update(run_statuses)
        codes.update(run_codes)
        problems.extend(run_problems)
        took = max(took, seconds)
    print("4xx codes:", dict(codes.most_common(20)))
    return statuses, problems, took


def _fuzz_mode(mode: str, base_url: str, model: str, route: str, examples: int):
    """One generation mode's run (``positive`` or ``negative``), on the schema the graph serves: (status counts
    per operation, 4xx codes, problems, seconds it took)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    mode = schemathesis.GenerationMode(mode)

    statuses: Counter = Counter()
    codes: Counter = Counter()
    problems: list[str] = []
    session = requests.Session()

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=("generate",))
    @given(case=st.one_of(schema[route]["POST"].as_strategy(mode), schema.as_strategy(mode)), aim=st.booleans())
    def run(case, aim):
        if aim and isinstance(case.body, dict) and {"model", "file"} & case.body.keys():  # a voice form has no model
            _aim(case.body, model, multipart=str(case.media_type or "").startswith("multipart/"))
        try:
            response = case.call(base_url=base_url, session=session, timeout=120)
        except Exception as exc:  # noqa: BLE001 - a dropped connection is a finding too
            problems.append(f"{exc!r} <- {case.as_curl_command()}")
            return
        statuses[f"{case.operation.label} {response.status_code}"] += 1
        error = _openai_error(response) if 400 <= response.status_code < 500 else None
        if error is not None:
            codes[f"{response.status_code} {error.get('code') or error['type']} {error.get('param')}"] += 1
        problem = _problem(response)
        if problem:
            problems.append(f"{problem} <- {case.as_curl_command()}")

    start = time.monotonic()
    run()
    return statuses, codes, problems, time.monotonic() - start


@pytest.mark.parametrize("app", APPS)
def test_fuzzed_requests_get_no_5xx_and_crash_no_replica(fuzz_apps, app):
    base_url, model, route, stages, positive, start = fuzz_apps[app]
    before, runs = start()
    assert len(before) == len(stages) + 1, before
    statuses, problems, took = _collect(runs)
    print(f"\n{app}: {sum(statuses.values())} requests in {took:.0f} s: {dict(sorted(statuses.items()))}")
    assert not problems, f"{len(problems)} bad answers, e.g.:\n" + "\n".join(problems[:10])
    assert sum(statuses.values()) >= (positive + EXAMPLES) * 0.9  # hypothesis may stop early on a tiny space; not here
    assert any(k.endswith(" 200") and k.startswith("POST") for k in statuses), "no generation ever succeeded"
    assert _replicas(app) == before, "a replica crashed or was replaced"
    if route == "/v1/videos":  # the jobs the fuzz created run after it: all of them end
        _wait_for_jobs(base_url)
    assert not busy_stages(base_url)


def _wait_for_jobs(base_url: str, timeout_s: float = 300) -> None:
    import httpx

    def active() -> list[str]:
        page = httpx.get(base_url + "/v1/videos?limit=100", timeout=30).json()["data"]
        return [job["id"] for job in page if job["status"] in ("queued", "in_progress")]
    deadline = time.monotonic() + timeout_s
    while active():
        assert time.monotonic() < deadline, f"video jobs still running {timeout_s} s after the fuzz: {active()}"
        time.sleep(0.5)
