"""Upgrade guard: what omni_serve's vLLM backend relies on, checked in the vLLM environment itself.

Runs the vLLM environment's interpreter (``$OMNI_SERVE_VLLM_PYTHON``, which ``make test`` sets; skipped with that
reason otherwise) on ``CHECK``: the pinned version, torchvision importable through the .pth hook, the model
runner internals the hidden-state tap reads, vLLM's request-id suffix, and the tap's receiver end to end over a
real ZeroMQ socket. A vLLM upgrade that moves any of these fails here, naming what moved.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from omni_serve.engines.vllm_engine.config import VLLM_PYTHON_ENV

PYTHON = os.environ.get(VLLM_PYTHON_ENV)
pytestmark = pytest.mark.skipif(not PYTHON or not os.path.exists(PYTHON),
                                reason=f"no vLLM environment: run `make vllm-env` and set {VLLM_PYTHON_ENV}")

CHECK = r'''
import asyncio, inspect, json
import numpy as np, torch
from omni_serve.engines.vllm_engine import compat
print("version", compat.check_version())
import torchvision  # the .pth hook makes the CUDA wheel importable beside the CPU torch
import vllm.model_executor.models.qwen2_5_omni_thinker  # the model class imports torchvision
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.metrics.stats import IterationStats
src = inspect.getsource(GPUModelRunner)
for needle in ("def _model_forward(", "self.query_start_loc = ", "self.requests: dict[str, CachedRequestState]",
               "model_output = self._model_forward(", "self.inputs_embeds"):
    assert needle in src, f"GPUModelRunner lost {needle!r}"
assert "sampling_params" in CachedRequestState.__dataclass_fields__, "CachedRequestState.sampling_params"
assert "num_computed_tokens_cpu" in inspect.getsource(InputBatch), "InputBatch.num_computed_tokens_cpu"
assert 'f"{request.external_req_id}-{random_uuid():.8}"' in inspect.getsource(InputProcessor.assign_request_id)
assert hasattr(IterationStats(), "num_preempted_reqs")
assert CPUModelRunner._model_forward is GPUModelRunner._model_forward
from omni_serve.engines.vllm_engine.tap import TapReceiver, TAP_KEY
import zmq

async def round_trip():
    rx = TapReceiver()
    await rx.start()
    rows = rx.register("req-1")
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(rx.address)
    h = np.arange(8, dtype=np.float32).reshape(2, 4)
    sock.send_multipart([json.dumps({"reqs": [["other", 0, 1], ["req-1", 0, 1]], "dim": 4}).encode(), h, -h])
    got, emb = await rows.take(1, timeout_s=10)
    rx.close()
    assert got.tolist() == [[4, 5, 6, 7]] and emb.tolist() == [[-4, -5, -6, -7]], (got, emb)
asyncio.run(round_trip())
print("ok")
'''


def test_vllm_environment_still_has_what_the_backend_relies_on():
    out = subprocess.run([PYTHON, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok") and "version 0.32.0" in out.stdout
