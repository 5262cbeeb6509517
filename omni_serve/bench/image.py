"""``omni-serve bench --mode image``: OpenAI image generation (or image edits) against a running endpoint vs
diffusers in process.

Contract: ``run_image_bench(ImageBenchConfig) -> BenchOutcome`` (the runner's: report dict, JSON path, PNG
path, printable table, runs); the report is ``omni_serve.bench.image_report``'s.

* Workload (``build_image_workload``): a pure function of the config. ``num_requests`` prompts of 4 to 12
  words from ``omni_serve.bench.workload.WORDS`` drawn with ``random.Random(seed)``; request ``i`` uses noise
  seed ``seed + i`` and the config's size, steps, ``n``, ``true_cfg_scale`` and ``negative_prompt``. With
  ``endpoint="edits"`` each request also gets its input image: a PNG of ``input_size``, random 8x8-pixel
  blocks from ``numpy.random.default_rng(seed + i)`` upscaled bilinearly.
* Engine runs (``run_image_load``): per ``concurrency`` value, a closed loop keeping C requests in flight
  (``httpx.AsyncClient``, ``POST /v1/images/generations``, or ``/v1/images/edits`` as multipart with the
  input image and the cache settings as ``cache[...]`` form fields; ``response_format: b64_json``). The uncached
  runs send ``cache: {"mode": "off"}`` so they are comparable with diffusers; each ``cache_modes`` entry
  adds one run at ``cache_concurrency`` with ``cache: {mode, residual_diff_threshold}``. Per request
  (``ImageRecord``): ok or the error (HTTP status + OpenAI error message, transport error, timeout, a
  response without exactly ``n`` decodable images; failures are counted, never dropped; a 429 is *rejected*,
  counted apart from them and not sent again), start time, E2E
  (request sent -> response body read; PNG decoding is not timed), the decoded images (uint8 HxWx3 numpy,
  in memory only) and the server's per-image computed / cached step counts. ``warmup`` unmeasured requests
  run first, for the uncached engine and for each cache mode.
* Baseline ``diffusers``: ``run_image_bench(cfg, baseline)`` calls ``baseline(cfg)`` (the served family's, from its
  bench plug-in in ``benchmarks/<family>/``) for an ``ImageBaseline`` and runs the same requests through it after the
  engine runs; ``ImageRequest.pipeline_kwargs`` are the requests' diffusers pipeline arguments.
* Images/s and requests/s count successful requests over each run's wall time (first start -> last end).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve.bench.client import _error_message, chat_url, closed_loop, discover_model, progress_logger
from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.runner import BenchOutcome
from omni_serve.bench.server import baseline_phase
from omni_serve.bench.workload import WORDS

log = logging.getLogger(__name__)

STYLES = ("A photo of", "A watercolor painting of", "A sketch of", "A 3D render of", "An oil painting of",
          "A poster of", "A close-up of", "A wide shot of")


class ImageBenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the running server, e.g. http://127.0.0.1:8000.")
    checkpoint: str | None = Field(None, description=(
        "Local Qwen-Image checkpoint directory (the baseline's; a Qwen-Image-Edit one for edits)."))
    endpoint: Literal["generations", "edits"] = Field("generations", description=(
        "POST /v1/images/generations, or /v1/images/edits (each request with its own input image)."))
    input_size: str = Field("256x256", description="Input image size of edits 'WIDTHxHEIGHT'.")
    model: str | None = Field(None, description="Model id in requests; default: the first id at /v1/models.")
    num_requests: int = Field(16, ge=1, description="Requests per run.")
    concurrency: list[int] = Field(default_factory=lambda: [1, 8],
                                   description="Closed-loop sweep: requests kept in flight, one run each.")
    size: str = Field("256x256", description="Image size 'WIDTHxHEIGHT'.")
    steps: int = Field(20, ge=1, description="num_inference_steps per image.")
    n: int = Field(1, ge=1, description="Images per request.")
    true_cfg_scale: float | None = Field(None, ge=0, description="CFG scale (None: the server's / diffusers' 4.0).")
    negative_prompt: str | None = Field(None, description="Negative prompt; None: no classifier-free guidance.")
    seed: int = Field(0, ge=0, description="Workload seed; request i uses noise seed seed + i.")
    warmup: int = Field(1, ge=0, description="Unmeasured requests per system (and cache mode) first.")
    baseline: Literal["diffusers", "none"] = Field("diffusers", description="In-process baseline, or none.")
    threads: int | None = Field(None, ge=1, description="torch threads of the in-process baseline (default: all).")
    baseline_dtype: Literal["float32", "bfloat16"] = Field("float32", description=(
        "dtype of the in-process baseline pipeline (every component: diffusers' pipelines run one dtype). Set it "
        "to the served stages' engine.dtype, so both sides do the same arithmetic."))
    cache_modes: list[Literal["dbcache", "taylorseer"]] = Field(
        default_factory=lambda: ["dbcache"], description="One cached engine run per mode; [] skips them.")
    cache_threshold: float = Field(0.2, gt=0, description="cache.residual_diff_threshold of the cached runs.")
    cache_concurrency: int | None = Field(None, ge=1, description="Concurrency of the cached runs (default: max).")
    out: str = Field("bench_out", description="Directory for image_bench_report.json / .png.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout in seconds.")
    progress_every: int = Field(10, ge=0, description="Log progress every K requests (0: off).")
    stop_server_pid: int | None = Field(None, description=(
        "PID of the local server process: after the engine runs it gets SIGTERM and the baseline waits for "
        "it to exit, so the baseline runs on a quiet machine (idle Ray processes slow multi-threaded torch)."))

    @field_validator("size", "input_size")
    @classmethod
    def _size(cls, value: str) -> str:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", value):
            raise ValueError("size must be 'WIDTHxHEIGHT', e.g. 256x256")
        return value

    @model_validator(mode="after")
    def _check(self) -> "ImageBenchConfig":
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency values must be >= 1")
        if self.baseline == "diffusers" and not self.checkpoint:
            raise ValueError("the diffusers baseline needs --checkpoint (a local Qwen-Image checkpoint directory)")
        if self.cache_concurrency is None:
            self.cache_concurrency = max(self.concurrency)
        return self

    def dimensions(self, size: str | None = None) -> tuple[int, int]:
        width, height = (size or self.size).split("x")
        return int(width), int(height)


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class ImageRequest:
    index: int
    prompt: str
    seed: int
    width: int
    height: int
    steps: int
    n: int = 1
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    input_image: bytes | None = None  # PNG: an edit request (POST /v1/images/edits)

    def body(self, model: str | None, cache: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``POST /v1/images/generations`` JSON."""
        body: dict[str, Any] = {"prompt": self.prompt, "n": self.n, "size": f"{self.width}x{self.height}",
                                "response_format": "b64_json", "seed": self.seed, "num_inference_steps": self.steps}
        if model:
            body["model"] = model
        if self.true_cfg_scale is not None:
            body["true_cfg_scale"] = self.true_cfg_scale
        if self.negative_prompt is not None:
            body["negative_prompt"] = self.negative_prompt
        if cache is not None:
            body["cache"] = cache
        return body

    def form(self, model: str | None, cache: dict[str, Any] | None = None) -> tuple[dict[str, str], dict]:
        """The ``POST /v1/images/edits`` multipart form: (fields, files), as the official client sends it."""
        fields = {k: str(v) for k, v in self.body(model).items() if k != "cache"}
        fields.update({f"cache[{k}]": str(v) for k, v in (cache or {}).items()})
        return fields, {"image": ("input.png", self.input_image, "image/png")}

    def pipeline_kwargs(self, glm: bool = False) -> dict[str, Any]:
        """``QwenImagePipeline.__call__`` (or ``QwenImageEditPipeline.__call__``; ``glm``: ``GlmImagePipeline.__call__``)
        arguments, the generator aside, matching ``body``/``form``."""
        kw: dict[str, Any] = {"prompt": self.prompt, "width": self.width, "height": self.height,
                              "num_inference_steps": self.steps, "num_images_per_prompt": self.n,
                              "output_type": "np"}
        if glm:  # no negative prompt (the server refuses one); the CFG scale is guidance_scale, 1.5 by default
            if self.true_cfg_scale is not None:
                kw["guidance_scale"] = self.true_cfg_scale
            return kw
        if self.input_image is not None:
            from PIL import Image

            kw["image"] = Image.open(io.BytesIO(self.input_image)).convert("RGB")
        if self.negative_prompt is None:
            kw["true_cfg_scale"] = 1.0  # no CFG on either side; avoids diffusers' per-call warning
        else:
            kw["negative_prompt"] = self.negative_prompt
            if self.true_cfg_scale is not None:
                kw["true_cfg_scale"] = self.true_cfg_scale
        return kw


def input_png(width: int, height: int, seed: int) -> bytes:
    """A deterministic input image for edits: random 8x8-pixel blocks, upscaled bilinearly."""
    import numpy as np
    from PIL import Image

    blocks = np.random.default_rng(seed).random((max(1, height // 8), max(1, width // 8), 3))
    image = Image.fromarray((blocks * 255).astype(np.uint8)).resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def build_image_workload(cfg: ImageBenchConfig) -> list[ImageRequest]:
    rng = random.Random(cfg.seed)
    width, height = cfg.dimensions()
    out = []
    for i in range(cfg.num_requests):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        image = input_png(*cfg.dimensions(cfg.input_size), cfg.seed + i) if cfg.endpoint == "edits" else None
        out.append(ImageRequest(index=i, prompt=f"{rng.choice(STYLES)} {words}", seed=cfg.seed + i, width=width,
                                height=height, steps=cfg.steps, n=cfg.n, true_cfg_scale=cfg.true_cfg_scale,
                                negative_prompt=cfg.negative_prompt, input_image=image))
    return out


# --------------------------------------------------------------------------- records

RECORD_KEYS = ("index", "ok", "start_s", "e2e_s", "status", "error", "num_images", "computed_steps",
               "cached_steps", "cache_mode")


@dataclass
class ImageRecord(RequestRecord):
    num_images: int = 0
    computed_steps: list[int] = field(default_factory=list)  # per image
    cached_steps: list[int] = field(default_factory=list)  # per image
    cache_mode: str | None = None
    images: list[Any] = field(default_factory=list, repr=False)  # uint8 [H, W, 3] arrays; never serialized

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RECORD_KEYS}


@dataclass
class ImageRunResult(RunResult):
    cache_mode: str = "off"  # what the run asked for ("off" for the baseline)
    records: list[ImageRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("label", "system", "mode", "concurrency", "wall_s", "cache_mode", "notes")}
        d["records"] = [r.to_dict() for r in self.records]
        return d


# --------------------------------------------------------------------------- HTTP engine


def images_url(url: str, endpoint: str = "generations") -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> the image-generations (or image-edits) endpoint."""
    return chat_url(url)[: -len("/chat/completions")] + f"/images/{endpoint}"


def decode_png(b64: str):
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)


def _read_response(rec: ImageRecord, payload: Any, n: int) -> None:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or len(data) != n:
        rec.error = f"expected {n} image(s), got {len(data) if isinstance(data, list) else 'no data list'}"
        return
    rec.images = [decode_png(d["b64_json"]) for d in data]
    rec.num_images = len(rec.images)
    metrics = payload.get("metrics") or {}
    rec.computed_steps = list(metrics.get("computed_steps") or [])
    rec.cached_steps = list(metrics.get("cached_steps") or [])
    rec.cache_mode = metrics.get("cache_mode")
    rec.ok = True


async def send_image(client: httpx.AsyncClient, url: str, req: ImageRequest, model: str | None, *,
                     cache: dict[str, Any] | None = None, t_run: float | None = None) -> ImageRecord:
    """One request to ``url`` (the image-generations endpoint, or image-edits for a request with an input image);
    never raises for request failures."""
    rec = ImageRecord(index=req.index)
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run if t_run is not None else 0.0
    try:
        if req.input_image is None:
            resp = await client.post(url, json=req.body(model, cache))
        else:
            fields, files = req.form(model, cache)
            resp = await client.post(url, data=fields, files=files)
        rec.e2e_s = time.perf_counter() - t0
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.error = _error_message(resp.status_code, resp.content)
            rec.rejections = int(resp.status_code == 429)  # at capacity: rejected, counted apart from failures
        else:
            _read_response(rec, resp.json(), req.n)
    except httpx.TimeoutException as exc:
        rec.error = f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        rec.error = f"transport error: {type(exc).__name__}: {exc}"[:300]
    except (ValueError, KeyError, TypeError, OSError) as exc:  # bad JSON, base64 or PNG
        rec.error = f"bad response: {type(exc).__name__}: {exc}"[:300]
    if rec.e2e_s is None:
        rec.e2e_s = time.perf_counter() - t0
    if rec.error is not None:
        rec.ok, rec.images = False, []
    return rec


async def run_image_load(url: str, requests: list[ImageRequest], model: str | None, concurrency: int, *,
                         cache: dict[str, Any] | None = None, timeout_s: float = 600.0,
                         transport: httpx.AsyncBaseTransport | None = None, progress_every: int = 10,
                         label: str | None = None) -> ImageRunResult:
    """Closed loop: ``concurrency`` requests in flight until all are done; one record per request."""
    mode = (cache or {}).get("mode", "off")
    label = label or (f"engine c={concurrency}" if mode == "off" else f"engine {mode} c={concurrency}")
    endpoint = images_url(url, "edits" if requests and requests[0].input_image is not None else "generations")

    async def send(client: httpx.AsyncClient, req: ImageRequest, t_run: float) -> ImageRecord:
        return await send_image(client, endpoint, req, model, cache=cache, t_run=t_run)

    on_done = progress_logger(label, len(requests), progress_every)
    records, wall = await closed_loop(requests, concurrency, send, on_done, timeout_s=timeout_s, transport=transport)
    final = [r or ImageRecord(index=q.index, error="request was never completed") for r, q in zip(records, requests)]
    return ImageRunResult(label=label, system="engine", mode="image", concurrency=concurrency, wall_s=wall,
                          streaming=False, records=final, cache_mode=mode)


# --------------------------------------------------------------------------- runner


def _engine_runs(cfg: ImageBenchConfig, requests: list[ImageRequest], model: str | None) -> list[ImageRunResult]:
    def load(reqs, concurrency, cache, label=None, progress_every=cfg.progress_every):
        return asyncio.run(run_image_load(cfg.url, reqs, model, concurrency, cache=cache, timeout_s=cfg.timeout_s,
                                          progress_every=progress_every, label=label))

    def warm(cache: dict[str, Any]) -> None:
        if cfg.warmup:
            w = load(requests[: cfg.warmup], 1, cache, label=f"warmup {cache['mode']}", progress_every=0)
            if w.num_errors or w.num_rejected:
                log.warning("warm-up request failed: %s", next(r.error for r in w.records if not r.ok))

    off = {"mode": "off"}
    warm(off)
    runs = []
    for c in cfg.concurrency:
        log.info("engine run c=%d: %d requests ...", c, len(requests))
        runs.append(load(requests, c, off))
    for mode in cfg.cache_modes:
        cache = {"mode": mode, "residual_diff_threshold": cfg.cache_threshold}
        warm(cache)
        log.info("engine run %s c=%d: %d requests ...", mode, cfg.cache_concurrency, len(requests))
        runs.append(load(requests, cfg.cache_concurrency, cache))
    return runs


class ImageBaseline(Protocol):
    """An in-process image system: the same requests one at a time, after ``warmup`` unmeasured ones."""

    def run(self, requests: list[ImageRequest], warmup: int = 1, progress_every: int = 10) -> ImageRunResult:
        """One run of every request (``system`` names the baseline, e.g. ``diffusers``)."""


def run_image_bench(cfg: ImageBenchConfig,
                    baseline: Callable[[ImageBenchConfig], ImageBaseline] | None = None) -> BenchOutcome:
    from omni_serve.bench.image_report import build_image_report, format_image_table, write_image_report
    from omni_serve.bench.machine import machine_info

    requests = build_image_workload(cfg)
    model = cfg.model or asyncio.run(discover_model(cfg.url))
    if model is None:
        log.warning("could not list models at %s; requests name no model (the server's default)", cfg.url)
    notes = [f"engine: {images_url(cfg.url, cfg.endpoint)} model {model!r}, response_format b64_json (PNG); "
             "uncached runs send cache.mode=off"]
    if cfg.endpoint == "edits":
        notes.append(f"edits: each request edits its own {cfg.input_size} input image (conditioning at ~1 MP)")
    machine = machine_info(cfg.url)
    runs = _engine_runs(cfg, requests, model)
    chosen = "diffusers" if cfg.baseline == "diffusers" else None
    runs += baseline_phase(cfg, requests, baseline, chosen, {}, notes)
    report = build_image_report(runs, config={**cfg.model_dump(mode="json"), "machine": machine}, notes=notes)
    json_path, png_path = write_image_report(report, runs, cfg.out)
    return BenchOutcome(report=report, json_path=json_path, png_path=png_path, table=format_image_table(report),
                        runs=runs)
