"""Graph and stage specs: everything that differs per deployment lives here, never in graph code.

Contract: a graph module declares its defaults as a ``GraphSpec`` subclass; ``build_app`` validates
user values (Python dict, ``serve run module:build_app key=value``, or a Serve config file's ``args``)
against it and binds one Ray Serve deployment per stage with ``StageSpec.deployment_options()``.
Dotted keys (``stages.thinker.num_replicas=2``) override nested fields.
"""

from __future__ import annotations

import os
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve.engines.ar.config import ARConfig
from omni_serve.engines.vllm_engine.config import VLLM_PYTHON_ENV, VllmSettings
from omni_serve.parallel.spec import ParallelSpec
from omni_serve.transport.config import DataPlaneSpec


class SpecModel(BaseModel):
    """Base of spec sections: unknown keys fail, and a field whose default comes from a ``default_factory``
    keeps the factory's values for the keys a user leaves out. Setting ``{"code2wav": {"num_replicas": 2}}``
    changes only that key of the code2wav stage's own defaults (its smaller ``num_cpus``, say), and
    ``env_vars: {X: "1"}`` adds X to the default variables."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _over_factory_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is None or field.default_factory is None or not isinstance(value, dict):
                continue
            default = field.default_factory()
            if isinstance(default, BaseModel):
                default = default.model_dump(exclude_unset=True)  # only what the factory set
            if isinstance(default, dict):
                out[name] = merge(default, value)
        return out


class EngineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_active_requests: int = Field(64, ge=1, description=(
        "Requests a replica accepts at once (an AR stage batches up to ar.max_num_seqs of them); more wait."))
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads of the replica's engine thread.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype of the stage.")
    device: str = Field("cpu", description="torch device of the stage's weights (e.g. 'cpu', 'cuda').")
    ar: ARConfig = Field(default_factory=ARConfig, description=(
        "Continuous batching and paged KV cache settings (autoregressive stages only)."))
    backend: Literal["native", "vllm"] = Field("native", description=(
        "Engine that runs the stage: 'native' (omni_serve's engines on transformers' layers) or 'vllm' (vLLM's "
        "AsyncLLM; only stages that declare a vllm runner, e.g. the Qwen2.5-Omni thinker). See docs/vllm.md."))
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="vLLM settings (backend: vllm only).")

    def python(self) -> str | None:
        """The interpreter the stage's replicas run in when it is not the serving one (the vLLM environment)."""
        if self.backend != "vllm":
            return None
        return self.vllm.python or os.environ.get(VLLM_PYTHON_ENV) or None

    def torch_dtype(self):
        """``dtype`` as a torch dtype (torch is imported only by the stages that load weights)."""
        import torch

        return getattr(torch, self.dtype)


# Default environment of stage processes (see StageSpec.env_vars): threads of GNU OpenMP (PyTorch's CPU runtime)
# spin ~10k iterations between parallel regions and then sleep (other runtimes get the portable PASSIVE policy).
# glibc's malloc thresholds (MALLOC_MMAP_THRESHOLD_ at its 32 MiB maximum, MALLOC_TRIM_THRESHOLD_) were measured
# and left out: Qwen-Image waves took the same time and DiT CPU with and without them (docs/qwen_image.md).
STAGE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


MAX_SURGE_DESCRIPTION = (
    "Extra replicas a rolling update of this deployment (a redeploy that changes it) may start, in percent of its "
    "replica count, rounded up. Above 0 the replacements start before the old replicas stop, and the old ones keep "
    "serving while the cluster has no room for the new ones, so the deployment never runs out of replicas while it "
    "rolls. 0 is Ray Serve's default: stop first (a one-replica deployment cannot serve while its replacement "
    "starts).")


class StageSpec(SpecModel):
    """One stage = one Ray Serve deployment."""

    num_replicas: int | None = Field(1, ge=1, description=(
        "Fixed replica count (ignored when autoscaling_config is set). A family's sizing rule may size it to the "
        "cluster when you leave it unset (the graph's `sizing`)."))
    autoscaling_config: dict[str, Any] | None = Field(None, description=(
        "Ray Serve autoscaling_config (min_replicas, max_replicas, upscale_delay_s, downscale_delay_s, "
        "look_back_period_s, policy, ...). Without a `policy`, the stage scales on its engine's load "
        "(omni_serve.autoscaling:EngineLoadPolicy, target_load 0.7); see docs/autoscaling.md."))
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per replica (logical, for scheduling).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica.")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Custom Ray resources reserved per replica, e.g. {'omni_ar_gpu': 1}: places the stage on the worker "
        "group (node type) that declares them (see docs/kubernetes.md)."))
    max_ongoing_requests: int = Field(64, ge=1, description="Ray Serve cap on concurrent calls per replica.")
    max_queued_requests: int = Field(64, ge=-1, description=(
        "Calls an ingress replica queues for this stage while every replica of it is at max_ongoing_requests; "
        "past it a request is answered 503 at once with the ingress' Retry-After (ingress.retry_after_s) "
        "instead of waiting into its deadline (-1: unbounded)."))
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0, description=(
        "Seconds a stopping replica (scale-down, redeploy, shutdown) gets to finish its requests: Serve stops "
        "routing calls to it and waits for those in flight; the replica then drains its engine (no new requests, "
        "the rest aborted with a 503 the client may retry) and frees it. Serve kills the replica when the time is "
        "up. Null (the default): the request deadline, ingress.request_timeout_s, the longest a request can "
        "hold a replica, so a redeploy loses no request. An idle replica stops at once whatever the value."))
    max_surge_percent: int = Field(100, ge=0, le=100, description=MAX_SURGE_DESCRIPTION)
    max_step_s: float = Field(300.0, gt=0, description=(
        "Longest one engine step (one batched forward) may run: past it the replica's health check fails and "
        "Serve replaces the replica, failing its requests with a 503 the client may retry (a hung kernel or a "
        "deadlock must not hold requests until their deadline). Steps of large models on CPU can take tens of "
        "seconds; keep it well above the longest step."))
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings inside each replica.")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description=(
        "Ranks one replica spans (stages that support it: the DiTs' rows). See docs/parallel.md."))
    env_vars: dict[str, str] = Field(default_factory=lambda: dict(STAGE_ENV), description=(
        "Environment variables of each replica's process (Ray runtime_env). The default makes idle OpenMP threads "
        "sleep after ~0.1 ms instead of spinning for ~3 ms (a spinning or preempted thread on a shared CPU stalls the "
        "other stages' multi-threaded ops), but not between two back-to-back ops of one forward: "
        "OMP_WAIT_POLICY=PASSIVE alone (no spinning at all) made a 2-thread DiT step 2-3.5x slower, every "
        "parallel region waiting for its threads to wake (GOMP_SPINCOUNT, which GNU OpenMP reads first, keeps "
        "them spinning ~10k iterations). Entries you set are added to the default; an entry set to null removes "
        "that variable (e.g. `stages.dit.env_vars.OMP_WAIT_POLICY=null`)."))
    params: dict[str, Any] = Field(default_factory=dict, description="Stage-specific settings (see the graph's docs).")

    # the parallel kinds (ParallelSpec fields) this stage's runner supports; others must stay 1
    parallel_kinds: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _parallel_supported(self) -> "StageSpec":
        p = self.parallel
        unsupported = sorted(set(p.kinds()) - set(self.parallel_kinds))
        if unsupported:
            raise ValueError(f"parallel.{unsupported[0]} > 1 is not supported by this stage (it supports: "
                             f"{', '.join(self.parallel_kinds) or 'none'})")
        if p.ranks > 1:  # placement-group bundles: none may be empty, and ranks share the replica's device kind
            rank_cpus, rank_gpus = p.rank_resources(self.num_cpus, self.num_gpus)
            if not (self.num_cpus or self.num_gpus):
                raise ValueError("a stage with parallel ranks needs num_cpus or num_gpus above 0 (its replica's "
                                 "placement-group bundle cannot be empty)")
            if not (rank_cpus or rank_gpus):
                raise ValueError("parallel.rank_cpus or parallel.rank_gpus must be above 0 (a rank's bundle cannot "
                                 "be empty)")
            if bool(self.num_gpus) != bool(rank_gpus):
                raise ValueError("the replica and its ranks must all have GPUs or none (parallel.rank_gpus)")
        return self

    @field_validator("env_vars", mode="before")
    @classmethod
    def _drop_removed_env_vars(cls, value: Any) -> Any:
        """Defaults are merged in first (``SpecModel``), so a null entry is how a user removes one of them. A number
        or boolean (a YAML file's or a command line's ``MALLOC_TRIM_THRESHOLD_=1073741824``) becomes its text:
        environment variables are strings."""
        if isinstance(value, dict):
            return {k: (str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, (int, float)) else v)
                    for k, v in value.items() if v is not None}
        return value

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else checked_autoscaling_config(value)

    @field_validator("max_queued_requests")
    @classmethod
    def _queue(cls, value: int) -> int:
        if value == 0:
            raise ValueError("max_queued_requests must be -1 (unbounded) or at least 1 (Ray Serve's rule)")
        return value

    def shutdown_timeout_s(self, request_timeout_s: float) -> float:
        """Seconds a stopping replica gets: ``graceful_shutdown_timeout_s``, or the request deadline."""
        given = self.graceful_shutdown_timeout_s
        return request_timeout_s if given is None else given

    def deployment_options(self, name: str, request_timeout_s: float = 300.0) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "name": name,
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "health_check_period_s": 5,
            "graceful_shutdown_timeout_s": self.shutdown_timeout_s(request_timeout_s),
            "max_surge_percent": self.max_surge_percent,
        }
        if self.resources:
            opts["ray_actor_options"]["resources"] = dict(self.resources)
        runtime_env: dict[str, Any] = {}
        if self.env_vars:
            runtime_env["env_vars"] = dict(self.env_vars)
        python = self.engine.python()
        if python:
            runtime_env["py_executable"] = python
        if runtime_env:
            opts["ray_actor_options"]["runtime_env"] = runtime_env
        if self.parallel.ranks > 1:  # the replica's bundle, then one per extra rank, on one node
            from omni_serve.parallel.group import rank_bundles

            replica = {**opts["ray_actor_options"].get("resources", {}), "CPU": self.num_cpus}
            if self.num_gpus:
                replica["GPU"] = self.num_gpus
            rank_cpus, rank_gpus = self.parallel.rank_resources(self.num_cpus, self.num_gpus)
            opts["placement_group_bundles"] = rank_bundles(replica, rank_cpus, self.parallel.ranks - 1, rank_gpus)
            opts["placement_group_strategy"] = "STRICT_PACK"
        if self.autoscaling_config:
            opts["autoscaling_config"] = self.autoscaling_config
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class EdgeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    connector: str = Field("auto", description=(
        "Data-plane backend carrying this edge's tensors: a name in the connector registry "
        "(omni_serve.transport.registry: the built-in backends and those of the omni_serve.connectors "
        "entry-point group), or 'auto' (the default: the fastest one that reaches every replica, chosen when the "
        "graph is built; see OMNI_SERVE_AUTO_CONNECTOR). The backends and their settings: docs/data_plane.md."))
    chunk_size: int = Field(8, ge=1, description="Items (tokens/states) per streamed chunk.")
    first_chunk_size: int = Field(1, ge=1, description="Items in the first chunk (smaller cuts time to first output).")

    @field_validator("connector")
    @classmethod
    def _registered(cls, value: str) -> str:
        from omni_serve.transport.registry import check_connector

        return check_connector(value)


class IngressSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1, description="Ingress replicas (ignored when autoscaling_config is set).")
    autoscaling_config: dict[str, Any] | None = Field(None, description=(
        "Ray Serve autoscaling_config of the ingress (it has no engine: Serve's default policy, on ongoing "
        "HTTP requests per replica, target_ongoing_requests)."))
    num_cpus: float = Field(0.25, ge=0, description="CPUs reserved per ingress replica.")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Custom Ray resources reserved per ingress replica, e.g. {'omni_ingress': 1}: places the ingress on the "
        "nodes that declare them (see docs/multinode.md)."))
    max_ongoing_requests: int = Field(256, ge=1, description="Concurrent HTTP requests per ingress replica.")
    max_surge_percent: int = Field(100, ge=0, le=100, description=MAX_SURGE_DESCRIPTION)
    request_timeout_s: float = Field(300.0, gt=0, description=(
        "Deadline for one request across all stages (504 past it); a request's X-Request-Timeout header "
        "may lower it."))
    max_inflight_requests: int = Field(128, ge=1, description=(
        "Requests in flight per ingress replica (a stream counts until it ends); more are answered 429 with "
        "Retry-After at once instead of queueing into a timeout."))
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After of the 429 and 503 overload answers.")
    max_realtime_sessions: int = Field(32, ge=1, description=(
        "Open realtime (WebSocket) sessions per ingress replica; beyond, a connection is accepted and closed at once "
        "with code 1013 (try again later). A session's responses are admitted by the graph's real-time capacity "
        "(playback.admission), not by max_inflight_requests."))
    max_queued_requests: int = Field(256, ge=-1, description=(
        "Requests Ray Serve queues for the ingress while every replica is at max_ongoing_requests; more get "
        "503 with Retry-After (-1: unbounded)."))
    api_keys: list[str] = Field(default_factory=list, description=(
        "API keys accepted as 'Authorization: Bearer <key>' on every /v1/* route and /metrics (401 otherwise). "
        "Keys are also read from the OMNI_SERVE_API_KEY environment variable (comma-separated) and from "
        "api_key_file; prefer those, since spec values are visible in the Serve config. No key anywhere: "
        "the API is open."))
    api_key_file: str | None = Field(None, description=(
        "File with one API key per line (e.g. a mounted Kubernetes Secret); read when the ingress starts."))
    enable_docs: bool = Field(False, description="Serve /docs, /redoc and /openapi.json (off: 404).")
    max_body_bytes: int = Field(32 << 20, ge=1024, description=(
        "Largest request body, bytes (413 beyond it, checked from Content-Length and while reading, before "
        "anything is parsed). Base64 media count at 4/3 of their size."))
    body_timeout_s: float = Field(60.0, gt=0, description=(
        "Seconds a client may take to send its whole request body (408 past it: a slow body cannot hold the "
        "ingress)."))

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from ray.serve.config import AutoscalingConfig

            _importable(value.get("policy") or {}, lambda: AutoscalingConfig.model_validate(value))
        return value


ImageFormat = Literal["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"]


class RequestLimits(BaseModel):
    """Limits on what one request may carry, checked at the ingress before anything is decoded or tokenized."""

    model_config = ConfigDict(extra="forbid")

    max_prompt_chars: int = Field(100_000, ge=1, description=(
        "Most characters of text in one request (all messages' text, or a prompt and its negative prompt), "
        "checked before tokenizing."))
    max_media_parts: int = Field(16, ge=0, description="Most media parts (images, audio clips) in one request.")
    max_messages: int = Field(1024, ge=1, description=(
        "Most messages in one chat request, counted before the body is validated."))
    max_content_parts: int = Field(4096, ge=1, description=(
        "Most content parts in all of a chat request's messages together, counted before the body is validated "
        "(with max_messages and max_prompt_chars it also bounds the JSON objects a body may hold)."))
    max_audio_sample_rate: int = Field(48_000, ge=8_000, description=(
        "Highest sample rate of input audio (Hz), read from the file's header before decoding."))
    max_audio_channels: int = Field(2, ge=1, description="Most channels of input audio, read from the header.")
    max_total_image_pixels: int = Field(4096 * 4096, ge=256, description=(
        "Most pixels of all of a request's images together, read from their headers before decoding."))
    image_formats: list[ImageFormat] = Field(["PNG", "JPEG", "WEBP", "GIF"], min_length=1, description=(
        "Image formats accepted (PIL decodes no other)."))


class LoggingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    encoding: Literal["TEXT", "JSON"] = Field("TEXT", description=(
        "Replica log format (Ray Serve logging_config): JSON gives one object per line with request_id, "
        "deployment, replica and message fields."))
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Replica log level.")
    enable_access_log: bool = Field(True, description=(
        "Serve's per-call access lines (each stage call logs its request id, method, status and duration)."))


class GraphSpecBase(SpecModel):
    """Fields every graph spec has. A family's spec adds its own (and may override these fields' descriptions and
    defaults), and its ``stages``/``edges`` sections derived from its graph declaration (``GraphDef.stages_model``
    / ``edges_model``)."""

    checkpoint: str = Field(..., description="Local checkpoint directory of the family's model.")
    model_name: str = Field(..., description="Model id served at /v1/models and accepted in requests.")
    data_timeout_s: float | None = Field(None, gt=0, description=(
        "How long a stage waits for an upstream payload; null (the default): the request deadline, "
        "ingress.request_timeout_s. Waiting includes the upstream stages' queueing and compute under load; a "
        "producer that dies fails its call at the ingress first, which then cancels every call of the request."))
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="HTTP ingress deployment.")
    data_plane: DataPlaneSpec = Field(default_factory=DataPlaneSpec, description=(
        "Settings of the data-plane backends the edges use: data_plane.<connector>.<field>, validated by that "
        "connector's Settings model (the keys: docs/data_plane.md)."))
    limits: RequestLimits = Field(default_factory=RequestLimits, description=(
        "What one request may carry (text, media parts, audio format, image pixels and formats)."))
    sizing: Literal["auto", "off"] = Field("auto", description=(
        "auto: the defaults that depend on the machine (replica counts, where the family declares a rule) are "
        "sized to the cluster's CPUs when the graph is built, under every value you set; the builder logs what it "
        "chose. off: the static defaults. See docs/speech_under_load.md#defaults-sized-to-the-cluster."))

    @field_validator("sizing", mode="before")
    @classmethod
    def _sizing_from_yaml(cls, value: Any) -> Any:
        """YAML (a config file, ``sizing=off`` on the command line) reads off/on as booleans."""
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    def layout(self) -> str:
        """The graph layout this spec deploys (``GraphDef.layouts``); families with several override it."""
        return "default"

    def data_timeout(self) -> float:
        """Seconds a stage waits for an upstream payload."""
        return self.data_timeout_s or self.ingress.request_timeout_s

    def stage_spec(self, stage: str) -> "StageSpec":
        return getattr(self.stages, stage)

    def edge_spec(self, edge: str) -> "EdgeSpec":
        return getattr(self.edges, edge)

    logging: LoggingSpec = Field(default_factory=LoggingSpec, description=(
        "Logging of every deployment of the graph. Each line of a request carries its request id (the "
        "client's X-Request-ID, or Serve's), in every stage: see docs/observability.md."))

    autoscaling_policy: dict[str, Any] | None = Field(None, description=(
        "Application-level Ray Serve autoscaling policy ({policy_function, policy_kwargs}), e.g. "
        "omni_serve.autoscaling:StageRatioPolicy: decides every autoscaled stage together (it overrides "
        "their own policies). Takes effect through a Serve config file: `omni-serve build` writes it there."))

    @field_validator("autoscaling_policy")
    @classmethod
    def _autoscaling_policy(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        from ray.serve.config import AutoscalingPolicy

        from omni_serve.autoscaling import check_policy

        check_policy(value, application=True)
        _importable(value, lambda: AutoscalingPolicy.model_validate(value))
        return value


def checked_autoscaling_config(value: dict[str, Any]) -> dict[str, Any]:
    """A stage's autoscaling_config with omni_serve's default policy filled in, validated by Ray Serve."""
    from ray.serve.config import AutoscalingConfig

    from omni_serve.autoscaling import ENGINE_LOAD_POLICY, check_policy

    value = dict(value)
    policy = dict(value.get("policy") or {"policy_function": ENGINE_LOAD_POLICY})
    value["policy"] = policy
    check_policy(policy, application=False)
    _importable(policy, lambda: AutoscalingConfig.model_validate(value))
    return value


def _importable(policy: dict[str, Any], validate: Callable[[], Any]) -> None:
    """Run Ray's ``validate()``, which imports ``policy``'s function; a wrong path becomes a clear ValueError."""
    try:
        validate()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"autoscaling policy_function {policy.get('policy_function')!r} cannot be "
                         f"imported ({exc}); expected 'package.module:Name'") from exc


def apply_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """Expand dotted keys into nested dicts: {'a.b': 1} -> {'a': {'b': 1}}."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
