"""One request on an autoregressive stage, as the AR engine sees it.

Contract: a sequence is a growing list of *input rows* (an embedding ``[E]`` and a position column
``[R]`` each: R = 1 for plain RoPE, 3 or 4 for M-RoPE layouts) of which the first ``num_computed`` have
their keys/values in the KV cache. The engine, from its worker thread and under the request's lock:
- calls ``poll()`` so the sequence can turn inputs that arrived from upstream into rows;
- schedules ``[num_computed, num_computed + n)`` for some ``n <= num_pending()`` (chunked prefill),
  reading them with ``rows(start, end)``;
- after the forward, calls ``computed(start, end, hidden, logits)``: ``hidden`` is ``[end - start, H]``
  when ``wants_hidden``, ``logits`` ``[V]`` of the last row when ``end`` completes every known row for the
  first time (``needs_logits``). The sequence samples there, appends the sampled token's row with
  ``append`` and returns its outputs for the caller (and its downstream chunks).
- A sequence may also end in ``poll()`` without computing anything (e.g. a talker whose thinker produced no
  reply state): it sets ``done`` and leaves its last outputs in ``outbox``; the engine emits them and ends
  the request.
- On preemption the engine frees the sequence's blocks and calls ``preempted()``: ``num_computed`` goes
  back to 0 and the rows are recomputed later; logits and hidden states already consumed are not
  produced twice, so outputs are exactly those of an uninterrupted run.
Batched follow-up (optional): a sequence whose sampled token needs more model work before its next row exists
(the Qwen3-Omni talker's code predictor, run per codec frame) sets ``followup`` in ``on_computed`` (the
follow-up's inputs) and returns no outputs for it yet. After the step's forward the engine hands the follow-ups
of every sequence in the step to the model's ``run_followups`` in one call, clears ``followup``, and calls
``on_followup(result)``, which appends the next row and returns the outputs, as ``on_computed`` would have.
Pacing (optional): ``pace(now)`` says whether the sequence's pending rows are due (``Pace.DUE``, the default: the
engine schedules them as above), may ride along in a step that runs anyway (``Pace.RIDE``: computed only when
other rows are due, where a row costs little more than the step's fixed part) or wait (``Pace.HOLD``). A sequence
whose output is consumed at a known rate (a talker feeding audio a client plays in real time) uses it to stay a
bounded lead ahead instead of taking the cores from streams that need them now.
``prefix_hashes`` (chained block hashes of prompt rows, or empty) lets the engine share cached prompt
blocks; ``max_rows`` is the most rows the request can reach (prompt + generation limit).

KV hand-off between engines (prefill/decode disaggregation), both optional:
- export: a sequence with ``export_kv_rows = n`` is a prefill-only request. Once rows ``[0, n)`` are
  computed (and their ``computed`` call returned), the engine gathers their keys/values from its cache and
  calls ``kv_exported(KVTransfer)``, which returns the outputs carrying the hand-off and ends the sequence
  (``done``). ``KVTransfer.logits`` is left None by the engine: the sequence attaches what it needs.
- import: a sequence whose ``kv_import`` is set when it is admitted has rows ``[0, kv_import.num_rows)``
  computed elsewhere. The engine writes that KV into its cache instead of computing the rows, drops
  ``kv_import`` and calls ``computed(0, n, None, kv_import.logits)`` as if it had run the forward
  itself (``logits``: those of row ``n - 1``, or None). After a preemption the rows are simply recomputed
  from the sequence's embeddings, like any other rows.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

import torch

from omni_serve.engines.base import StageProgram


@dataclass
class KVTransfer:
    """Keys/values of rows ``[0, n)`` of one request: ``k``/``v`` ``[layers, n, kv_heads, head_dim]``, and the
    next-token ``logits`` ``[V]`` of row ``n - 1`` when the receiving sequence samples from them."""

    k: torch.Tensor
    v: torch.Tensor
    logits: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]


class Pace(enum.Enum):
    """Whether a sequence's pending rows go in the next step (see the module doc)."""

    DUE = "due"  # schedule them
    RIDE = "ride"  # only in a step other rows make run
    HOLD = "hold"  # not now


class ARSequence(StageProgram):
    wants_hidden: bool = False
    export_kv_rows: int | None = None  # prefill-only: hand rows [0, n) off once computed (see module doc)
    kv_import: KVTransfer | None = None  # rows computed elsewhere, written into the cache on admission
    followup: object | None = None  # set by on_computed: model work batched across the step (see module doc)

    def __init__(self, embed_dim: int, position_rows: int, dtype: torch.dtype = torch.float32):
        self._emb = torch.empty(0, embed_dim, dtype=dtype)
        self._pos = torch.empty(position_rows, 0, dtype=torch.long)
        self.num_rows = 0
        self.num_computed = 0
        self.logits_done = 0  # rows whose next-token logits were consumed
        self.prefix_hashes: list[int] = []
        self.max_rows = 0
        self.done = False
        self.outbox: list[dict] = []  # outputs produced in poll(), emitted by the engine after it

    # -- rows ---------------------------------------------------------------------------------------------
    def append(self, embeds: torch.Tensor, positions: torch.Tensor) -> None:
        """Add rows: ``embeds [n, E]``, ``positions [R, n]``."""
        n = embeds.shape[0]
        need = self.num_rows + n
        if need > self._emb.shape[0]:
            cap = max(need, 2 * self._emb.shape[0], 16)
            emb = torch.empty(cap, self._emb.shape[1], dtype=self._emb.dtype)
            emb[:self.num_rows] = self._emb[:self.num_rows]
            pos = torch.empty(self._pos.shape[0], cap, dtype=torch.long)
            pos[:, :self.num_rows] = self._pos[:, :self.num_rows]
            self._emb, self._pos = emb, pos
        self._emb[self.num_rows:need] = embeds.to(self._emb.dtype)
        self._pos[:, self.num_rows:need] = positions
        self.num_rows = need

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._emb[start:end], self._pos[:, start:end]

    def num_pending(self) -> int:
        return 0 if self.done else self.num_rows - self.num_computed

    def needs_logits(self, end: int) -> bool:
        return end == self.num_rows and end > self.logits_done

    def preempted(self) -> None:
        self.num_computed = 0

    def pace(self, now: float) -> Pace:
        """Whether the pending rows are due at ``now`` (``time.monotonic()``); see the module doc."""
        return Pace.DUE

    # -- engine hooks ---------------------------------------------------------------------------------------
    def poll(self) -> None:  # noqa: B027 - sequences fed only by their own samples need nothing here
        """Turn upstream inputs that arrived into rows (worker thread, under the request's lock)."""

    @abc.abstractmethod
    def on_computed(self, start: int, end: int, hidden: torch.Tensor | None,
                    logits: torch.Tensor | None) -> list[dict]:
        """Rows ``[start, end)`` are in the cache; sample if ``logits`` is given. Returns outputs."""

    def on_followup(self, result) -> list[dict]:
        """The result of this sequence's ``followup`` (batched by the model); returns outputs."""
        raise NotImplementedError(f"{type(self).__name__} sets no followup")

    def take_outbox(self) -> list[dict]:
        out, self.outbox = self.outbox, []
        return out

    def computed(self, start: int, end: int, hidden, logits) -> list[dict]:
        self.num_computed = max(self.num_computed, end)
        if logits is not None:
            self.logits_done = end
        return self.on_computed(start, end, hidden, logits)

    def exports_now(self) -> bool:
        """Whether the rows to hand off are all computed (the engine then calls ``kv_exported``)."""
        return self.export_kv_rows is not None and not self.done and self.num_computed >= self.export_kv_rows

    def kv_exported(self, kv: KVTransfer) -> list[dict]:
        """The KV of rows ``[0, export_kv_rows)``; returns the outputs carrying the hand-off, sets ``done``."""
        raise NotImplementedError(f"{type(self).__name__} exports no KV")

    # StageProgram: the AR engine drives sequences through the hooks above, not step().
    def ready(self) -> bool:
        return self.num_pending() > 0

    def step(self) -> list:
        raise RuntimeError("AR sequences are stepped by omni_serve.engines.ar.AREngine")
