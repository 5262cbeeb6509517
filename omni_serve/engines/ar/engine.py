"""The autoregressive engine: continuous batching over a paged KV cache, one batched forward per step.

Contract (see ``omni_serve.engines.loop.LoopEngine`` for the request lifecycle): programs are
``ARSequence``s; the model is an ``ARModel``. Every step the worker
1. frees the blocks of aborted requests (``abort`` only queues them: the worker owns the allocator's
   growth, so a request can never be handed blocks after it was freed);
2. schedules up to ``max_batch_tokens`` new rows: running requests first, in admission order (one row
   each when decoding, a chunk of the budget when prefilling), then waiting requests FIFO while there is
   room (``max_num_seqs``, free blocks above a small watermark), reusing cached prompt-prefix blocks; a
   running sequence that paces itself (``ARSequence.pace``) is left out while it holds, and joins only a step
   that other rows make run while it rides;
3. when a running request needs a block and none is free, preempts the most recently admitted request
   (frees its blocks; it is recomputed later, with identical outputs) — nothing is dropped; a request that
   could never fit in the whole cache is refused with a clear error at admission;
4. runs one packed forward for all scheduled rows and hands each request its hidden states / logits;
5. runs the follow-ups the step's sequences asked for (``ARSequence.followup``) as one batched model call.

KV hand-off (prefill/decode disaggregation, see ``ARSequence``): a sequence with ``export_kv_rows`` gets
its rows' keys/values gathered from the cache (``kv_exported``) in the step that computes the last of them;
a sequence admitted with ``kv_import`` gets that KV written into freshly allocated blocks instead of a
forward, is handed the imported logits, and is scheduled on in the same step.

Requests join and leave between steps. Memory is bounded by ``ARConfig.num_kv_blocks``; requests beyond
what fits wait (queue) or are preempted, never lost.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from omni_kernels import pack_linears

from omni_serve.engines.ar.attention import PagedBatch
from omni_serve.engines.ar.config import ARConfig
from omni_serve.engines.ar.decode_kv import DecodeKV
from omni_serve.engines.ar.kv_cache import BlockAllocator, PagedKVCache
from omni_serve.engines.ar.sequence import ARSequence, KVTransfer, Pace
from omni_serve.engines.load import DecayingMean
from omni_serve.engines.loop import END, LoopEngine, Slot, log_failure

if TYPE_CHECKING:
    from omni_serve.engines.registry import EngineSite

log = logging.getLogger(__name__)


class ARModel(Protocol):
    """What the engine needs from a model adapter (``omni_serve.models``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str
    modules: dict[str, torch.nn.Module]  # the model's torch modules (their linear layers get prepacked)

    def forward_packed(self, embeds: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                       logit_rows: torch.Tensor, want_hidden: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``embeds [T, E]``, ``positions [R, T]`` -> (hidden ``[T, H]`` or None, logits ``[len(logit_rows), V]``)."""

    # Optional, for sequences that set ``followup`` (see ``ARSequence``):
    # def run_followups(self, followups: list) -> list: one result per follow-up, computed as one batch.


def pack_model_linears(model: ARModel, config: ARConfig) -> int:
    """Prepack the linear layers of every module of ``model`` for oneDNN at the batch sizes ``config`` runs; the
    count packed."""
    return sum(pack_linears(m, batch_hint=min(config.max_num_seqs, 32), plain_max_rows=config.gemv_max_rows)
               for m in model.modules.values())


@dataclass
class _Work:
    slot: Slot
    start: int
    end: int
    logits: bool


class AREngine(LoopEngine):
    def __init__(self, name: str, model: ARModel, config: ARConfig | None = None, max_active: int = 256,
                 torch_threads: int | None = None):
        super().__init__(name, max_active=max_active, torch_threads=torch_threads)
        self.model = model
        self.config = config or ARConfig()
        c = self.config
        if c.packed_linear:
            packed = pack_model_linears(model, c)
            log.info("%s: %d linear layers prepacked for oneDNN", name, packed)
        self.cache = PagedKVCache(model.num_layers, model.num_kv_heads, model.head_dim, c.num_kv_blocks,
                                  c.block_size, model.dtype, model.device)
        self.blocks = BlockAllocator(c.num_kv_blocks, c.block_size)
        self.decode_kv = None
        if c.decode_kv_copy_mib:
            self.decode_kv = DecodeKV(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype,
                                      model.device, c.decode_kv_copy_mib * 2**20)
        self.watermark = max(1, c.num_kv_blocks // 100)
        self.running: list[Slot] = []
        self.waiting: deque[Slot] = deque()
        self._known: set[str] = set()
        self._released: list[Slot] = []
        self.counters = {"steps": 0, "batched_rows": 0, "preemptions": 0, "followup_calls": 0, "followups": 0,
                         "paced_waits": 0}  # scheduling passes (every 10 ms while idle) leaving paced rows out
        self._occupancy = DecayingMean()  # sequences per step / max_num_seqs
        self._blocked = 0  # waiting requests with work ready at the last step
        log.info("%s: KV cache %d blocks x %d tokens (%.1f MiB)", name, c.num_kv_blocks, c.block_size,
                 self.cache.nbytes / 2**20)

    # -- introspection ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"active": self.num_active, "running": len(self.running), "waiting": len(self.waiting),
                "kv_blocks_total": self.blocks.num_blocks, "kv_blocks_used": self.blocks.num_used_blocks,
                "kv_blocks_free": self.blocks.num_free_blocks, **self.counters,
                "prefix_hit_tokens": self.blocks.prefix_hits,
                "decode_kv_rebuilds": self.decode_kv.rebuilds if self.decode_kv else 0,
                "decode_kv_appends": self.decode_kv.appends if self.decode_kv else 0}

    # -- LoopEngine hooks ---------------------------------------------------------------------------------
    def on_abort(self, slot: Slot) -> None:
        with self._cv:
            self._released.append(slot)
            self._cv.notify_all()

    def has_work(self) -> bool:
        return bool(self._released) or super().has_work()

    def tick(self) -> None:
        self._reap()
        self._intake()
        plan = self._schedule()
        if not plan:  # everything waits on upstream or on blocks: sleep until something changes
            with self._cv:
                self._cv.wait(timeout=0.01)
            return False
        start, start_cpu = time.perf_counter(), time.thread_time()
        self._execute(plan)
        self.stepped(len(plan), time.perf_counter() - start, sum(w.end - w.start for w in plan),
                     time.thread_time() - start_cpu)
        self._occupancy.add(len(plan) / self.config.max_num_seqs)
        return True

    def backlog(self) -> float:
        """Requests ready to compute but left waiting at the last step (no batch slot or KV blocks), in
        full batches; requests waiting only for upstream inputs do not count."""
        return self._blocked / self.config.max_num_seqs

    def extra_load(self) -> dict[str, float]:
        return {"kv_used_fraction": self.blocks.num_used_blocks / self.blocks.num_blocks,
                "batch_occupancy": self._occupancy.value(), "running": float(len(self.running)),
                "waiting": float(len(self.waiting)), "ready_waiting": float(self._blocked)}

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _drop(self, slot: Slot) -> None:
        self.blocks.free(slot.request_id)
        self._known.discard(slot.request_id)
        if slot in self.running:
            self.running.remove(slot)
        if slot in self.waiting:
            self.waiting.remove(slot)

    def _reap(self) -> None:
        with self._cv:
            released, self._released = self._released, []
        # Requests ended outside the worker (upstream failure) without an abort are swept here too.
        released += [s for s in (*self.running, *self.waiting) if s.finished and s not in released]
        for slot in released:
            self._drop(slot)
            with slot.lock:
                slot.program.release()

    def _intake(self) -> None:
        for slot in self.live_slots():
            if slot.request_id not in self._known:
                self._known.add(slot.request_id)
                self.waiting.append(slot)

    def _fail(self, slot: Slot, exc: BaseException) -> None:
        self._drop(slot)
        with slot.lock:
            slot.program.release()
        self.finish(slot, exc)

    def _preempt(self, slot: Slot) -> None:
        self.blocks.free(slot.request_id)
        with slot.lock:
            slot.program.preempted()
        self.running.remove(slot)
        self.waiting.appendleft(slot)
        self.counters["preemptions"] += 1
        log.debug("%s: preempted %s (KV cache full)", self.name, slot.request_id)

    # -- scheduling ---------------------------------------------------------------------------------------
    def _poll(self, slot: Slot) -> int:
        """Rows ``slot`` could compute now (its upstream inputs were turned into rows by ``_poll_all``)."""
        with slot.lock:
            return slot.program.num_pending()

    def _poll_all(self) -> None:
        """Let every sequence turn arrived inputs into rows; one that raises fails alone (not the engine)."""
        for slot in [*self.running, *self.waiting]:
            try:
                with slot.lock:
                    slot.program.poll()
                    outputs = slot.program.take_outbox()
            except Exception as exc:  # noqa: BLE001 - reported to the request's caller
                log_failure(log, exc, "%s: request %s failed", self.name, slot.request_id)
                self._fail(slot, exc)
                continue
            if outputs:
                self.emit(slot, outputs)
            if slot.program.done:  # ended in poll (nothing to compute)
                self._end(slot)

    def _schedule(self) -> list[_Work]:
        self._poll_all()
        now = time.monotonic()
        paced_out: list[Slot] = []  # running sequences with rows that hold or ride, in admission order
        plan = self._schedule_due(now, paced_out)
        budget = self.config.max_batch_tokens - sum(w.end - w.start for w in plan)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            # pace is not asked here: a new sequence has its prompt to compute, a preempted one its rows again
            slot = next((s for s in self.waiting if self._poll(s) > 0), None)
            if slot is None:
                break
            need = self.blocks.blocks_for(max(slot.program.max_rows, slot.program.num_rows))
            if need > self.blocks.num_blocks:
                self._fail(slot, ValueError(
                    f"{self.name}: the request needs {need} KV blocks (prompt + max tokens = "
                    f"{slot.program.max_rows}) but the cache holds {self.blocks.num_blocks}; lower max_tokens "
                    "or raise num_kv_blocks"))
                continue
            work = self._admit(slot, budget)
            if work is None:
                break  # FIFO: later requests do not jump a request waiting for blocks
            if work.end > work.start:  # an imported request may have nothing left to compute this step
                plan.append(work)
                budget -= work.end - work.start
        if paced_out:
            riders = self._riders(now, paced_out, budget) if plan else []  # they join a step that runs anyway
            plan += riders
            if len(riders) < sum(1 for s in paced_out if s in self.running):
                self.counters["paced_waits"] += 1
        # ready to compute but left waiting (no batch slot, token budget or blocks): the backlog
        self._blocked = sum(1 for s in self.waiting if self._poll(s) > 0)
        return plan

    def _schedule_due(self, now: float, paced_out: list[Slot]) -> list[_Work]:
        """Rows of the running sequences that are due, within the step's token budget, in admission order; those
        that hold or ride go to ``paced_out``. One that needs a block when none is free preempts the most recently
        admitted sequence that is ahead (holds or rides), else the most recently admitted (possibly itself)."""
        budget, plan = self.config.max_batch_tokens, []
        i = 0
        while i < len(self.running) and budget > 0:
            slot = self.running[i]
            seq: ARSequence = slot.program
            n = min(self._poll(slot), budget)
            if n and seq.pace(now) is not Pace.DUE:
                paced_out.append(slot)
                n = 0
            if n == 0:
                i += 1
                continue
            start = seq.num_computed
            end = start + n
            while not self.blocks.allocate(slot.request_id, end):
                k = self._victim(slot, now)
                victim = self.running[k]
                self._preempt(victim)
                if k < i:
                    i -= 1  # a sequence before this one that is ahead (not in this step: it was left out)
                if victim is slot:
                    break
            if slot not in self.running:
                continue  # preempted itself: back in the queue
            plan.append(_Work(slot, start, end, seq.needs_logits(end)))
            budget -= n
            i += 1
        return plan

    def _riders(self, now: float, paced_out: list[Slot], budget: int) -> list[_Work]:
        """Rows of the sequences in ``paced_out`` that ride (not preempted since), within ``budget`` tokens. A rider
        never preempts: it is left out when no block is free (the victim could be in this step already)."""
        plan = []
        for slot in paced_out:
            seq: ARSequence = slot.program
            n = min(self._poll(slot), budget)
            if n == 0 or slot not in self.running or seq.pace(now) is not Pace.RIDE:
                continue
            start = seq.num_computed
            if self.blocks.allocate(slot.request_id, start + n):
                plan.append(_Work(slot, start, start + n, seq.needs_logits(start + n)))
                budget -= n
        return plan

    def _victim(self, slot: Slot, now: float) -> int:
        """The index in ``running`` of the sequence to preempt for ``slot``'s blocks: the most recently admitted one
        that holds or rides (it is ahead; none of them is in the step yet), else the most recently admitted."""
        for k in range(len(self.running) - 1, -1, -1):
            s = self.running[k]
            if s is not slot and s.program.pace(now) is not Pace.DUE:
                return k
        return len(self.running) - 1

    def _admit(self, slot: Slot, budget: int) -> _Work | None:
        seq: ARSequence = slot.program
        rid = slot.request_id
        if seq.kv_import is not None:
            return self._admit_imported(slot, budget)
        if seq.num_computed == 0 and seq.prefix_hashes and self.config.enable_prefix_caching:
            with slot.lock:
                seq.num_computed = self.blocks.match_prefix(rid, seq.prefix_hashes)
        n = min(seq.num_pending(), budget)
        end = seq.num_computed + n
        free_after = self.blocks.num_free_blocks - (self.blocks.blocks_for(end) - len(self.blocks.table(rid)))
        if free_after < self.watermark or not self.blocks.allocate(rid, end):
            self.blocks.free(rid)
            with slot.lock:
                seq.preempted()
            return None
        self.waiting.remove(slot)
        self.running.append(slot)
        return _Work(slot, seq.num_computed, end, seq.needs_logits(end))

    def _admit_imported(self, slot: Slot, budget: int) -> _Work | None:
        """Admit a request whose first rows were computed elsewhere: write their KV into new blocks, hand the
        sequence the imported logits, then schedule what it has left (its first sampled token's row)."""
        seq: ARSequence = slot.program
        rid = slot.request_id
        kv = seq.kv_import
        n = kv.num_rows
        want = (self.model.num_layers, n, self.model.num_kv_heads, self.model.head_dim)
        if tuple(kv.k.shape) != want or tuple(kv.v.shape) != want or not 0 < n <= seq.num_rows:
            self._fail(slot, ValueError(
                f"{self.name}: imported KV has shape {tuple(kv.k.shape)}/{tuple(kv.v.shape)}, expected {want} "
                f"for {seq.num_rows} rows (prefill and decode must serve the same model)"))
            return _Work(slot, 0, 0, False)
        end = min(n + 1, max(seq.max_rows, seq.num_rows))  # the imported rows + the first sampled token
        free_after = self.blocks.num_free_blocks - self.blocks.blocks_for(end)
        if free_after < self.watermark or not self.blocks.allocate(rid, end):
            self.blocks.free(rid)
            return None
        slots = self.blocks.slots(rid, 0, n).to(self.cache.k.device)
        self.cache.k[:, slots] = kv.k.to(self.cache.k.device, self.cache.k.dtype)
        self.cache.v[:, slots] = kv.v.to(self.cache.v.device, self.cache.v.dtype)
        self.waiting.remove(slot)
        self.running.append(slot)
        with slot.lock:
            seq.kv_import = None  # from now on a preempted request recomputes these rows from its embeddings
        self._deliver(_Work(slot, 0, n, kv.logits is not None), None, kv.logits)
        if slot not in self.running or slot.aborted or slot.finished:  # ended on the imported logits alone
            return _Work(slot, n, n, False)
        start = seq.num_computed
        take = min(self._poll(slot), budget)
        if take == 0 or not self.blocks.allocate(rid, start + take):
            return _Work(slot, start, start, False)  # running: the next step schedules it
        return _Work(slot, start, start + take, seq.needs_logits(start + take))

    def _export(self, rid: str, n: int) -> KVTransfer:
        """Copies of the cached keys/values of ``rid``'s rows ``[0, n)``."""
        slots = self.blocks.slots(rid, 0, n).to(self.cache.k.device)
        return KVTransfer(self.cache.k[:, slots], self.cache.v[:, slots])

    # -- execution ----------------------------------------------------------------------------------------
    def _execute(self, plan: list[_Work]) -> None:
        embeds, positions, segments, logit_rows = [], [], [], []
        want_hidden = False
        row = 0
        for w in plan:
            seq: ARSequence = w.slot.program
            with w.slot.lock:
                e, p = seq.rows(w.start, w.end)
            embeds.append(e)
            positions.append(p)
            rid = w.slot.request_id
            read = self.blocks.slots(rid, 0, w.end)  # the new tokens' write slots are its tail
            segments.append((rid, w.end - w.start, read[w.start:], read))
            row += w.end - w.start
            if w.logits:
                logit_rows.append(row - 1)
            want_hidden |= seq.wants_hidden
        batch = PagedBatch.build(self.cache, segments, self.decode_kv)
        try:
            hidden, logits = self.model.forward_packed(
                torch.cat(embeds), torch.cat(positions, dim=1), batch, torch.tensor(logit_rows, dtype=torch.long),
                want_hidden)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its requests, not the replica
            if self.decode_kv is not None:
                self.decode_kv.invalidate()  # some layers may have appended this step's token, others not
            log_failure(log, exc, "%s: batched forward failed", self.name)
            for w in plan:
                self._fail(w.slot, exc)
            return
        self.counters["steps"] += 1
        self.counters["batched_rows"] += row
        offset, k = 0, 0
        for w in plan:
            n = w.end - w.start
            h = hidden[offset:offset + n] if hidden is not None else None
            lg = None
            if w.logits:
                lg, k = logits[k], k + 1
            offset += n
            self._deliver(w, h, lg)
        self._run_followups([w.slot for w in plan])

    def _run_followups(self, slots: list[Slot]) -> None:
        """One batched model call for the follow-ups the step's sequences set; each gets its result."""
        pending = [s for s in slots if not (s.aborted or s.finished) and s.program.followup is not None]
        if not pending:
            return
        try:
            results = self.model.run_followups([s.program.followup for s in pending])
            self.counters["followup_calls"] += 1
            self.counters["followups"] += len(pending)
        except Exception as exc:  # noqa: BLE001 - a failed follow-up fails its requests, not the replica
            log_failure(log, exc, "%s: batched follow-up failed", self.name)
            for slot in pending:
                self._fail(slot, exc)
            return
        for slot, result in zip(pending, results):
            if slot.aborted or slot.finished:
                continue
            seq: ARSequence = slot.program
            try:
                with slot.lock:
                    seq.followup = None
                    outputs = seq.on_followup(result)
            except Exception as exc:  # noqa: BLE001 - reported to the request's caller
                log_failure(log, exc, "%s: request %s failed", self.name, slot.request_id)
                self._fail(slot, exc)
                continue
            self.emit(slot, outputs)
            if seq.done:
                self._end(slot)

    def _deliver(self, w: _Work, hidden, logits) -> None:
        slot = w.slot
        if slot.aborted or slot.finished:
            return
        seq: ARSequence = slot.program
        try:
            with slot.lock:
                if slot.aborted:
                    return
                outputs = seq.computed(w.start, w.end, hidden, logits)
                if seq.exports_now():
                    outputs = outputs + seq.kv_exported(self._export(slot.request_id, seq.export_kv_rows))
        except Exception as exc:  # noqa: BLE001 - reported to the request's caller
            log_failure(log, exc, "%s: request %s failed", self.name, slot.request_id)
            self._fail(slot, exc)
            return
        bs = self.config.block_size
        for b in range(w.start // bs, min(w.end // bs, len(seq.prefix_hashes))):
            self.blocks.register(slot.request_id, b, seq.prefix_hashes[b])
        self.emit(slot, outputs)
        if seq.done:
            self._end(slot)

    def _end(self, slot: Slot) -> None:
        """A sequence finished: free its blocks and memory, end its request successfully."""
        self._drop(slot)
        with slot.lock:
            slot.program.release()
        self.finish(slot, END)


def build_engine(site: "EngineSite") -> AREngine:
    """The ``ar`` engine kind (``omni_serve.engines.registry``): the stage's model with its ``engine.ar`` settings."""
    s = site.engine_spec
    return AREngine(site.stage.name, site.model, s.ar, max_active=s.max_active_requests, torch_threads=s.torch_threads,
                    **site.engine_options())
