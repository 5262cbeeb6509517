"""Parallel building blocks (``omni_serve.parallel``) on two gloo ranks in two processes, against one process: a
Qwen-Image DiT forward with its rows split across the ranks, with diffusers' context parallelism (Ulysses) on CPU
ranks, and the served packed forward with each rank holding a share of the image tokens (``SequenceShards``), each
equal to the one-process forward (float32 rounding; the tolerance below), on rows with a padded
text mask and odd lengths; a forward with two rows' prompts swapped fails the same comparison (the negative
control). And the work-around of ``omni_serve.parallel.context`` is still needed."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_serve.parallel.rows import row_parallel, row_range

REL_TOL = 1e-5  # measured ~1e-7: the same sums in another order


def test_row_range_gives_every_row_to_exactly_one_rank():
    for n in range(0, 11):
        for world in (1, 2, 3, 4):
            shares = [row_range(n, r, world) for r in range(world)]
            assert [i for s in shares for i in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def _inputs(checkpoint: str, n: int, swap: bool = False, grid: tuple[int, int] = (3, 5)):
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(checkpoint, subfolder="transformer").eval()
    g = torch.Generator().manual_seed(0)
    text_len = 7  # not divisible by 2 (nor, with the default grid, are the 15 image tokens)
    hidden = torch.randn(n, grid[0] * grid[1], model.config.in_channels, generator=g)
    text = torch.randn(n, text_len, model.config.joint_attention_dim, generator=g)
    mask = torch.ones(n, text_len, dtype=torch.bool)
    mask[1:, 4:] = False  # padded text rows
    if swap:
        text[[0, 1]] = text[[1, 0]]
    timestep = torch.linspace(0.2, 0.9, n)
    return model, hidden, text, mask, timestep, grid


def _forward(model, hidden, text, mask, timestep, grid, idx):
    with torch.no_grad():
        return model(hidden_states=hidden[idx], encoder_hidden_states=text[idx], encoder_hidden_states_mask=mask[idx],
                     timestep=timestep[idx], img_shapes=[[(1, *grid)]] * len(idx), return_dict=False)[0]


# Context parallelism on gloo shards the image tokens evenly: an image length the degree does not divide fails in
# gloo's all-gather (text lengths may be anything: diffusers' ulysses_anything pads them).
# The packed forward's sequence parallelism takes any length: 15 image tokens split 8 + 7.
GRID = {"rows": (3, 5), "context": (4, 4), "sequence": (3, 5)}


def _sequence_parallel(model, hidden, text, mask, timestep, grid, idx):
    """The served packed forward (rows' texts unpadded) with this rank's share of the image tokens."""
    from omni_serve.models.qwen_image_packed import PackedForward
    from omni_serve.parallel.sequence import SequenceShards

    forward = PackedForward(model)
    forward.shards = SequenceShards()
    with torch.no_grad():
        return forward(hidden[idx], [text[i][mask[i]] for i in idx], timestep[idx], [(1, *grid)])


def _rank(rank: int, port: int, kind: str, checkpoint: str, n: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, *rest = _inputs(checkpoint, n, grid=GRID[kind])
        if kind == "rows":
            out = row_parallel(lambda idx: _forward(model, *rest, idx), torch.arange(n))
        elif kind == "sequence":
            out = _sequence_parallel(model, *rest, torch.arange(n))
        else:
            from omni_serve.parallel.context import enable_context_parallel

            enable_context_parallel(model, 2)
            out = _forward(model, *rest, torch.arange(n))
        queue.put((rank, out.numpy().copy()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, *args, world: int = 2, timeout_s: float = 180) -> dict:
    """``target(rank, port, *args, queue)`` in ``world`` spawned processes (each puts ``(rank, result)`` on the
    queue); their results by rank, every process having exited cleanly."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def on_two_ranks(kind: str, checkpoint: str, n: int) -> list[np.ndarray]:
    results = spawn_ranks(_rank, kind, checkpoint, n)
    return [results[0], results[1]]


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind, n", [("rows", 3), ("rows", 1), ("context", 3), ("sequence", 3)])
def test_two_ranks_equal_one_and_a_swapped_prompt_does_not(qwen_image_tiny_dir, kind, n):
    model, *rest = _inputs(qwen_image_tiny_dir, n, grid=GRID[kind])
    one = _forward(model, *rest, torch.arange(n)).numpy()
    ranks = on_two_ranks(kind, qwen_image_tiny_dir, n)
    print(f"{kind}, {n} rows: relative error of the two ranks' result {max(_rel(g, one) for g in ranks):.2e}")
    for got in ranks:  # every rank ends with the whole result
        assert got.shape == one.shape and _rel(got, one) < REL_TOL, _rel(got, one)
    if n > 1:
        swapped, *srest = _inputs(qwen_image_tiny_dir, n, swap=True, grid=GRID[kind])
        control = _forward(swapped, *srest, torch.arange(n)).numpy()
        print(f"{kind}, {n} rows: swapped prompts move it by {_rel(control, one):.2e}")
        assert _rel(control, one) > 100 * REL_TOL, _rel(control, one)


def test_diffusers_still_needs_the_accelerator_count_work_around(qwen_image_tiny_dir):
    """diffusers resolves a rank's device as ``rank % torch.accelerator.device_count()``: on a CPU-only torch a
    division by zero. When this test fails, diffusers fixed it: drop ``accelerator_count_at_least_one``."""
    if torch.accelerator.device_count() > 0:
        pytest.skip("this torch has an accelerator: the division by zero cannot happen here")
    from diffusers import ContextParallelConfig

    from omni_serve.parallel.context import accelerator_count_at_least_one

    model, *_ = _inputs(qwen_image_tiny_dir, 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(ZeroDivisionError):
            model._resolve_parallel_config(ContextParallelConfig(ulysses_degree=2, ulysses_anything=True))
        with accelerator_count_at_least_one():
            assert torch.accelerator.device_count() == 1
    finally:
        dist.destroy_process_group()
