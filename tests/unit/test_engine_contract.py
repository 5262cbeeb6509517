"""The one engine contract (``omni_serve.engines.base.Engine``) without Ray: drain lets requests in flight finish and
refuses new ones, aborts what is left at its deadline, cleanup is idempotent, engines are chosen by kind through the
registry, the vLLM engine honours the same contract (over a fake ``AsyncLLM``: no vLLM needed), and the stage spec
hands its shutdown budget to Serve."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from omni_serve.api.errors import Draining
from omni_serve.engines.base import DrainReport, Engine, StageProgram
from omni_serve.engines.batch import BatchEngine
from omni_serve.engines.registry import engine_factory, known_engines, make_engine, register_engine
from omni_serve.engines.stepper import StepEngine
from omni_serve.engines.vllm_engine.config import VllmSettings
from omni_serve.engines.vllm_engine.engine import VllmEngine, VllmRequest


class Gated(StageProgram):
    """Emits ``steps`` outputs once ``gate`` is open (never, if it stays closed)."""

    def __init__(self, gate: threading.Event, steps: int = 2):
        self.gate, self.left, self.released = gate, steps, False

    def ready(self) -> bool:
        return self.gate.is_set() and not self.done

    def step(self) -> list:
        self.left -= 1
        self.done = self.left == 0
        return [self.left]

    def release(self) -> None:
        self.released = True


async def _outputs(engine: Engine, request_id: str, program) -> list:
    return [out async for out in engine.generate(request_id, program)]


def _settled(task, timeout_s: float = 5.0):
    """``task``'s outcome, failing (not hanging) the test when it does not end."""
    return asyncio.wait_for(task, timeout_s)


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


def test_drain_lets_requests_in_flight_finish_and_refuses_new_and_waiting_ones():
    async def main():
        engine = StepEngine("step", max_active=1)
        gate = threading.Event()
        running = asyncio.create_task(_outputs(engine, "r1", Gated(gate)))
        await _until(lambda: engine.num_active == 1)
        waiting = asyncio.create_task(_outputs(engine, "r2", Gated(gate)))
        await _until(lambda: engine.load()["queued"] == 1.0)
        drain = asyncio.create_task(engine.drain(deadline_s=10))
        await asyncio.sleep(0.01)
        with pytest.raises(Draining, match="draining"):
            await _settled(waiting)  # it had done no work: refused at once, not when a slot frees up
        with pytest.raises(Draining, match="admits no new request"):
            await _outputs(engine, "r3", Gated(gate))
        assert not drain.done() and engine.load()["queued"] == 0.0
        gate.set()
        engine.wake()
        assert await _settled(running) == [1, 0]
        report = await _settled(drain)
        assert report == DrainReport(finished=1, aborted=0, refused=1)
        await engine.cleanup()

    asyncio.run(main())


def test_drain_aborts_what_is_left_at_its_deadline_and_frees_it():
    async def main():
        engine = StepEngine("step")
        stuck = Gated(threading.Event())  # never ready
        running = asyncio.create_task(_outputs(engine, "r1", stuck))
        await _until(lambda: engine.num_active == 1)
        report = await engine.drain(deadline_s=0.05)
        assert report == DrainReport(finished=0, aborted=1, refused=0)
        with pytest.raises(Draining, match="shut down before it finished"):
            await _settled(running)
        assert stuck.released and engine.num_active == 0 and not engine.admission.admitted
        assert await engine.drain(deadline_s=0.05) == DrainReport()  # nothing left: returns at once
        await engine.cleanup()

    asyncio.run(main())


def test_cleanup_is_idempotent_and_ends_what_still_runs():
    async def main():
        engine = StepEngine("step")
        running = asyncio.create_task(_outputs(engine, "r1", Gated(threading.Event())))
        await _until(lambda: engine.num_active == 1)
        await engine.cleanup()
        await engine.cleanup()
        with pytest.raises(Draining):
            await _settled(running)
        with pytest.raises(Draining):
            await _outputs(engine, "r2", Gated(threading.Event()))

    asyncio.run(main())


def test_abort_ends_the_requests_generate_with_an_error():
    async def main():
        engine = StepEngine("step")
        program = Gated(threading.Event())
        running = asyncio.create_task(_outputs(engine, "r1", program))
        await _until(lambda: engine.num_active == 1)
        await engine.abort("r1")
        with pytest.raises(RuntimeError, match="aborted") as caught:
            await _settled(running)
        assert not isinstance(caught.value, Draining) and program.released
        await engine.cleanup()

    asyncio.run(main())


# -- registry ------------------------------------------------------------------------------------------------
def _site(**kw):
    spec = SimpleNamespace(max_active_requests=3, torch_threads=1, backend="native", dtype="float32", device="cpu",
                           ar=None, vllm=VllmSettings())
    base = dict(stage=SimpleNamespace(name="s"), spec=SimpleNamespace(checkpoint="/ckpt"), engine_spec=spec,
                model=None, work_unit=None, batch_compute=lambda: (lambda payloads: payloads),
                max_batch=lambda: 4, engine_options=lambda: {})
    return SimpleNamespace(**{**base, **kw})


def test_the_registry_builds_the_engine_of_each_kind_and_names_the_known_ones_on_a_typo():
    step = make_engine("step", _site())
    assert type(step) is StepEngine and step.name == "s" and step.max_active == 3
    batch = make_engine("batch", _site(work_unit="diffusion_steps"))
    assert type(batch) is BatchEngine and batch.max_batch == 4 and batch.work_unit == "diffusion_steps"
    vllm = make_engine("vllm", _site(engine_options=lambda: {"max_model_len": 512, "tap": False}))
    assert type(vllm) is VllmEngine and vllm.checkpoint == "/ckpt" and vllm.max_model_len == 512 and not vllm.tap
    assert {"ar", "batch", "step", "vllm"} <= set(known_engines())
    with pytest.raises(ValueError, match=r"unknown engine kind 'stpe'; known: ar, batch, step, vllm"):
        engine_factory("stpe")


def test_a_registered_kind_is_imported_when_first_used(monkeypatch):
    from omni_serve.engines import registry

    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))  # this test's registration ends with it
    register_engine("custom", "omni_serve.engines.stepper:build_engine")
    assert "custom" in known_engines() and type(make_engine("custom", _site())) is StepEngine


def test_a_runner_picks_its_declared_kind_or_its_backend():
    from omni_serve.graph.graph import EngineKind
    from omni_serve.graph.runner import StageRunner

    def kind(engine, backend):
        return StageRunner.engine_kind(SimpleNamespace(stage=SimpleNamespace(engine=engine),
                                                       engine_spec=SimpleNamespace(backend=backend)))

    assert kind(EngineKind.AR, "native") == "ar" and kind(EngineKind.BATCH, "native") == "batch"
    assert kind(EngineKind.AR, "vllm") == "vllm"


# -- the vLLM engine, over a fake AsyncLLM ------------------------------------------------------------------------
class FakeLLM:
    """``AsyncLLM``'s generate/abort/shutdown: a request yields one delta per released step; an abort ends it with
    vLLM's final ``abort`` output."""

    errored = False

    def __init__(self):
        self.steps: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []
        self.shutdowns = 0

    async def generate(self, prompt, params, request_id):
        queue = self.steps.setdefault(request_id, asyncio.Queue())
        for k in range(params["max_tokens"]):
            if await queue.get() == "abort":
                yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(token_ids=[], finish_reason="abort")])
                return
            last = k == params["max_tokens"] - 1
            yield SimpleNamespace(finished=last, outputs=[SimpleNamespace(token_ids=[k], finish_reason=None)])

    def step(self, request_id):
        self.steps.setdefault(request_id, asyncio.Queue()).put_nowait("step")

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.steps.setdefault(request_id, asyncio.Queue()).put_nowait("abort")

    def shutdown(self):
        self.shutdowns += 1


def _vllm_engine(max_active: int = 64) -> tuple[VllmEngine, FakeLLM]:
    engine = VllmEngine("thinker", "/ckpt", VllmSettings(), max_active=max_active, tap=False)
    engine.llm, engine._started = FakeLLM(), True  # as start() leaves it, without vLLM
    return engine, engine.llm


def _request(max_tokens: int = 2) -> VllmRequest:
    return VllmRequest({"prompt_token_ids": [1, 2]}, {"max_tokens": max_tokens})


def test_the_vllm_engine_has_the_whole_contract_and_the_native_load_keys():
    assert issubclass(VllmEngine, Engine) and not VllmEngine.__abstractmethods__
    assert {"start", "generate", "abort", "drain", "cleanup", "alive", "load", "stats"} <= Engine.__abstractmethods__
    engine, _ = _vllm_engine()
    native = StepEngine("step").load()
    assert set(native) <= set(engine.load())
    assert engine.alive and engine.stats()["active"] == 0

    async def main():
        with pytest.raises(ValueError, match="no streamed input"):
            await _outputs_with_inputs(engine)

    asyncio.run(main())


async def _outputs_with_inputs(engine):
    async def inputs():
        yield None

    return [out async for out in engine.generate("r", _request(), inputs())]


def test_the_vllm_engine_drains_like_the_native_ones():
    async def main():
        engine, llm = _vllm_engine(max_active=1)
        finishing = asyncio.create_task(_outputs(engine, "r1", _request()))
        await _until(lambda: engine.num_active == 1)
        waiting = asyncio.create_task(_outputs(engine, "r2", _request()))
        await _until(lambda: engine.load()["queued"] == 1.0)
        drain = asyncio.create_task(engine.drain(deadline_s=10))
        with pytest.raises(Draining):
            await _settled(waiting)
        llm.step("r1")
        llm.step("r1")
        assert [out.outputs[0].token_ids for out in await _settled(finishing)] == [[0], [1]]
        assert await _settled(drain) == DrainReport(finished=1, aborted=0, refused=1)

        engine, llm = _vllm_engine()
        stuck = asyncio.create_task(_outputs(engine, "r1", _request()))
        await _until(lambda: engine.num_active == 1)
        assert await engine.drain(deadline_s=0.05) == DrainReport(finished=0, aborted=1, refused=0)
        with pytest.raises(Draining, match="shut down before it finished"):
            await _settled(stuck)  # not vLLM's final "abort" output: an error the ingress answers with 503
        assert "r1" in llm.aborted and engine.num_active == 0
        await engine.cleanup()
        await engine.cleanup()
        assert llm.shutdowns == 1 and engine.llm is None

    asyncio.run(main())


# -- the ingress' answer and the spec ------------------------------------------------------------------------
def test_a_draining_stage_is_a_503_the_client_may_retry():
    from omni_serve.graph.calls import stage_error

    error = stage_error("thinker", Draining("engine thinker is draining"), "chatcmpl-abc")
    assert error.status_code == 503 and error.headers == {"Retry-After": "1"} and "chatcmpl-abc" in error.message


def test_the_stage_spec_hands_its_shutdown_budget_to_serve():
    from omni_serve.graph.spec import StageSpec

    assert StageSpec().deployment_options("s", request_timeout_s=120)["graceful_shutdown_timeout_s"] == 120
    assert StageSpec(graceful_shutdown_timeout_s=0).deployment_options("s")["graceful_shutdown_timeout_s"] == 0
    assert StageSpec(graceful_shutdown_timeout_s=90).deployment_options("s")["graceful_shutdown_timeout_s"] == 90
    with pytest.raises(ValueError):
        StageSpec(graceful_shutdown_timeout_s=-1)


def test_serve_takes_the_options_and_a_stopping_replica_drains_its_engine_then_frees_it():
    from omni_serve.deployments.stage import StageDeployment
    from omni_serve.graph.spec import StageSpec

    options = StageSpec(graceful_shutdown_timeout_s=0.05).deployment_options("s")
    deployment = StageDeployment.options(**options)  # Serve takes every option (no cluster needed)
    assert deployment._deployment_config.graceful_shutdown_timeout_s == 0.05

    async def main():
        engine = StepEngine("s")
        gate = threading.Event()
        finishing = asyncio.create_task(_outputs(engine, "r1", Gated(gate)))
        stuck = asyncio.create_task(_outputs(engine, "r2", Gated(threading.Event())))
        await _until(lambda: engine.num_active == 2)
        replica = SimpleNamespace(engine=engine, metrics=None, runner=SimpleNamespace(
            stage_spec=StageSpec(graceful_shutdown_timeout_s=0.5), close=lambda: None,
            # the replica drains up to the request deadline (Serve's own timeout stops it first when shorter)
            spec=SimpleNamespace(ingress=SimpleNamespace(request_timeout_s=0.5))))
        asyncio.get_running_loop().call_later(0.05, lambda: (gate.set(), engine.wake()))
        await StageDeployment.func_or_class.__del__(replica)  # what Serve calls once its own wait is over
        assert await _settled(finishing) == [1, 0]  # given its time: it finished
        with pytest.raises(Draining):
            await _settled(stuck)  # past the deadline: aborted
        assert engine._thread is None  # then the engine was freed

    asyncio.run(main())
