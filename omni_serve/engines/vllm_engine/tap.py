"""Per-token hidden states out of vLLM: a worker extension that taps the model runner's forward.

vLLM (0.32) has no output field for per-token hidden states, and its ``extract_hidden_states`` speculative
method fails on CPU (``pin_memory``) and writes only when a request ends. A thinker -> talker graph needs
them per step: every prompt row (for the talker's prompt) and every generated row, as soon as it is computed.

How (written for vLLM 0.32.0; ``compat.check_version`` guards it):
- ``HiddenStateTap`` is a vLLM *worker extension* (``worker_extension_cls``): vLLM mixes it into its worker
  class. ``omni_serve_tap_start(address)`` (called once through ``AsyncLLM.collective_rpc``) wraps the model
  runner's ``_model_forward`` (vLLM's documented override point for inspecting a forward) so that after every
  forward, for each request in the batch that asked for it (``SamplingParams.extra_args[TAP_KEY]``), it
  sends that request's rows: the final-norm hidden states and the input embeddings (the token's embedding,
  or for media placeholders the media embedding vLLM merged in), with the sequence index of the first row.
- Tensor parallelism (``tensor_parallel_size`` > 1): every tensor-parallel rank runs the tap (the embedding lookup of
  a text-only forward is vocabulary-parallel, a collective every rank must join), but only rank 0 sends: the
  final-norm hidden states and the embeddings are whole and equal on every rank.
- Rows go over a ZeroMQ PUSH socket (pyzmq ships with vLLM) to the replica's ``TapReceiver`` (PULL, an
  ``ipc://`` path in a private directory): one multipart message per forward (JSON header, hidden bytes,
  embedding bytes; float32). Sends never block the engine (no high-water mark).
- The receiver keeps ``TapRows`` per request. A row index already received is skipped, so rows recomputed
  after a preemption (vLLM recomputes preempted requests) are not delivered twice.
- Prefix caching must be off for tapped requests: cached prompt rows are not computed, so they have no
  hidden states (``VllmEngine`` turns it off when the tap is on).

The internal vLLM request id is ``<our id>-<8 random characters>`` (``InputProcessor.assign_request_id``);
the tap strips the suffix so rows are keyed by our request id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile

import numpy as np
import torch

log = logging.getLogger(__name__)
TAP_KEY = "omni_serve_tap"  # SamplingParams.extra_args key: stream this request's rows
TAP_METHOD = "omni_serve_tap_start"


def external_request_id(internal: str) -> str:
    """Our request id from vLLM's internal one (``<id>-<8 characters>``)."""
    return internal.rsplit("-", 1)[0]


# -- worker side (runs inside vLLM's worker process) ----------------------------------------------------------
class HiddenStateTap:
    """vLLM worker extension (``worker_extension_cls``): see the module doc."""

    def omni_serve_tap_start(self, address: str) -> int:
        import zmq
        from vllm.distributed import get_tensor_model_parallel_rank

        runner = self.model_runner
        if getattr(runner, "_omni_serve_tap", None) is not None:
            return os.getpid()
        sock = None
        if get_tensor_model_parallel_rank() == 0:  # the others compute along (collectives), send nothing
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        original = runner._model_forward

        def tapped_forward(*args, **kwargs):
            out = original(*args, **kwargs)
            try:
                _publish(runner, sock, out, kwargs)
            except Exception as exc:  # noqa: BLE001 - a broken tap fails its requests, not the engine
                log.exception("omni_serve hidden-state tap failed")
                if sock is not None:
                    sock.send_multipart([json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()])
            return out

        runner._model_forward = tapped_forward
        runner._omni_serve_tap = sock if sock is not None else True
        return os.getpid()


def _publish(runner, sock, out, kwargs) -> None:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = runner.query_start_loc.np[: num_reqs + 1]
    entries, rows = [], []
    for i, rid in enumerate(batch.req_ids[:num_reqs]):
        state = runner.requests.get(rid)
        params = None if state is None else state.sampling_params
        if params is None or not (params.extra_args or {}).get(TAP_KEY):
            continue
        lo, hi = int(starts[i]), int(starts[i + 1])
        entries.append([external_request_id(rid), int(batch.num_computed_tokens_cpu[i]), hi - lo])
        rows.append(torch.arange(lo, hi))
    if not entries:
        return
    index = torch.cat(rows)
    hidden = out[0] if isinstance(out, tuple) else out  # (hidden, aux) with EAGLE-3 auxiliary states
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:  # a text-only forward: the embedding of each row's token (a collective under TP)
        embeds = runner.model.embed_input_ids(kwargs["input_ids"][index])
    else:
        embeds = embeds[index]
    if sock is None:  # a tensor-parallel rank other than 0
        return
    h = hidden[index].float().contiguous().numpy()
    e = embeds.float().contiguous().numpy()
    header = {"reqs": entries, "dim": int(h.shape[1])}
    sock.send_multipart([json.dumps(header).encode(), h, e])


# -- replica side ------------------------------------------------------------------------------------------
class TapError(RuntimeError):
    pass


class TapRows:
    """One request's tapped rows, in sequence order; ``take(n)`` hands out the next rows once they arrived."""

    def __init__(self):
        self.count = 0  # rows received (sequence indices 0 .. count-1)
        self.taken = 0
        self._hidden: list[torch.Tensor] = []
        self._embeds: list[torch.Tensor] = []
        self._arrived = asyncio.Event()
        self.error: str | None = None

    def add(self, start: int, hidden: torch.Tensor, embeds: torch.Tensor) -> None:
        if start > self.count:
            self.fail(f"tapped rows skip from {self.count} to {start}")
            return
        skip = self.count - start  # rows recomputed after a preemption: already have them
        if skip >= hidden.shape[0]:
            return
        self._hidden.append(hidden[skip:])
        self._embeds.append(embeds[skip:])
        self.count += hidden.shape[0] - skip
        self._arrived.set()

    def fail(self, message: str) -> None:
        self.error = message
        self._arrived.set()

    async def take(self, n: int, timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``n`` rows (hidden [n, H], embeddings [n, H]), waiting for them at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.count < self.taken + n and self.error is None:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise TapError(f"hidden states of {n} rows did not arrive within {timeout_s:.0f} s "
                               f"(have {self.count - self.taken})") from None
        if self.error is not None:
            raise TapError(self.error)
        hidden, embeds = torch.cat(self._hidden), torch.cat(self._embeds)
        self._hidden, self._embeds = [hidden[n:]], [embeds[n:]]
        self.taken += n
        return hidden[:n], embeds[:n]


class TapReceiver:
    """The replica's end of the tap: a PULL socket routing rows to each registered request's ``TapRows``."""

    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="omni_serve_tap_")  # 0700: only this user can connect
        self.address = f"ipc://{os.path.join(self._dir, 'rows')}"
        self._requests: dict[str, TapRows] = {}
        self._sock = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._task = asyncio.get_running_loop().create_task(self._receive())

    def register(self, request_id: str) -> TapRows:
        rows = self._requests[request_id] = TapRows()
        return rows

    def unregister(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            header = json.loads(frames[0])
            if "error" in header:
                for rows in self._requests.values():
                    rows.fail(f"the hidden-state tap failed in vLLM's worker: {header['error']}")
                continue
            dim = header["dim"]
            hidden = torch.from_numpy(np.frombuffer(frames[1], dtype=np.float32).reshape(-1, dim).copy())
            embeds = torch.from_numpy(np.frombuffer(frames[2], dtype=np.float32).reshape(-1, dim).copy())
            offset = 0
            for rid, start, n in header["reqs"]:
                rows = self._requests.get(rid)
                if rows is not None:
                    rows.add(start, hidden[offset:offset + n], embeds[offset:offset + n])
                offset += n

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        shutil.rmtree(self._dir, ignore_errors=True)
