"""The engines on a CUDA device, as the GPU deployments run them (``stages.<stage>.engine.device: cuda``).

Marked ``gpu``: where torch sees no CUDA device, tests/conftest.py skips them with the reason. They hold the
engines on the device to the same oracles as the CPU tests:
- the AR engine (continuous batching, paged KV cache) on the tiny Qwen2.5-Omni thinker: several prompts in
  flight give, token for token, the greedy tokens of transformers' generate on the same device, each prompt
  alone, and the engine's own tokens on CPU;
- Qwen-Image's stages on their batch engines, with requests joining the DiT at different timesteps and sharing
  its forwards (step-level batching): each request's final latents and pixels equal diffusers'
  ``QwenImagePipeline`` on the same device and seed, and another request's prompt or seed fails that comparison.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_serve.checkpoints.qwen2_5_omni import TOKEN_ID
from omni_serve.engines.ar import ARConfig, AREngine
from omni_serve.engines.sampling import SamplingParams
from omni_serve.families.qwen2_5_omni.replica.programs import ThinkerRequest, ThinkerSequence
from omni_serve.models.qwen2_5_omni import OmniThinker
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from tests.unit.test_ar_engine import collect
from tests.unit.test_qwen_image_programs import check_batched_at_different_timesteps

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
EOS = TOKEN_ID["<|im_end|>"]
MAX_NEW_TOKENS = 16
PROMPTS = ("hello world cat", "what is the weather like by the sea today, and tomorrow?", "x")
# float32 on the device (no TF32 in matmuls, PyTorch's default): batch partners change the kernels' shapes and the
# order of sums, more than on CPU, so 10x the CPU tolerance; still 300x below what a swapped prompt moves
# (tests/image_oracle.py).
DEVICE_LATENT_ATOL = 1e-4


def _prompt_ids(proc: OmniInputProcessor) -> list[list[int]]:
    return [proc([{"role": "user", "content": [{"type": "text", "text": text}]}]).input_ids[0].tolist()
            for text in PROMPTS]


def engine_tokens(checkpoint: str, device: str, prompts: list[list[int]], tokenizer,
                  samplings: list[SamplingParams] | None = None) -> tuple[list[list[int]], dict]:
    """Tokens of every prompt (greedy, or by ``samplings[i]``), all in flight at once on one AR engine on ``device``;
    the engine's stats."""
    model = OmniThinker(checkpoint, device=device)
    greedy = SamplingParams(temperature=0, stop_token_ids=(EOS,))

    async def main():
        engine = AREngine("thinker", model, ARConfig())
        try:
            sequences = [ThinkerSequence(model, tokenizer, ThinkerRequest(
                input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(EOS,),
                sampling=samplings[i] if samplings else greedy)) for i, ids in enumerate(prompts)]
            tokens = await asyncio.gather(*(collect(engine, f"r{i}", s) for i, s in enumerate(sequences)))
            return tokens, engine.stats()
        finally:
            await engine.cleanup()
    return asyncio.run(main())


def transformers_tokens(checkpoint: str, device: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate of the thinker on ``device``, one prompt at a time."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    thinker = Qwen2_5OmniForConditionalGeneration.from_pretrained(checkpoint).thinker.to(device).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        seq = thinker.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW_TOKENS,
                               do_sample=False, eos_token_id=EOS)
        out.append(seq[0, len(ids):].tolist())
    return out


def test_ar_engine_on_the_device_gives_transformers_greedy_tokens(omni_tiny_dir):
    proc = OmniInputProcessor(omni_tiny_dir)
    prompts = _prompt_ids(proc)
    on_device, stats = engine_tokens(omni_tiny_dir, DEVICE, prompts, proc.tokenizer)
    assert stats["batched_rows"] > stats["steps"], "the prompts were never batched together"
    assert stats["kv_blocks_used"] == 0
    assert on_device == transformers_tokens(omni_tiny_dir, DEVICE, prompts)
    assert on_device == engine_tokens(omni_tiny_dir, "cpu", prompts, proc.tokenizer)[0]


def test_seeded_sampling_on_the_device_is_reproducible_and_gives_the_cpus_tokens(omni_tiny_dir):
    """Each request samples with its own host generator whatever the device (top-p, top-k, repetition penalty)."""
    proc = OmniInputProcessor(omni_tiny_dir)
    prompts = _prompt_ids(proc)
    samplings = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, stop_token_ids=(EOS,)),
                 SamplingParams(temperature=1.0, top_k=20, seed=2, stop_token_ids=(EOS,)),
                 SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=3, stop_token_ids=(EOS,))]
    on_device = engine_tokens(omni_tiny_dir, DEVICE, prompts, proc.tokenizer, samplings)[0]
    assert on_device == engine_tokens(omni_tiny_dir, DEVICE, prompts, proc.tokenizer, samplings)[0]
    assert on_device == engine_tokens(omni_tiny_dir, "cpu", prompts, proc.tokenizer, samplings)[0]
    other_seed = [SamplingParams(temperature=0.8, top_p=0.9, seed=9, stop_token_ids=(EOS,)), *samplings[1:]]
    assert engine_tokens(omni_tiny_dir, DEVICE, prompts, proc.tokenizer, other_seed)[0][0] != on_device[0]


def test_dit_batched_on_the_device_equals_diffusers_on_the_device(qwen_image_tiny_dir):
    from diffusers import QwenImagePipeline

    from omni_serve.models.qwen_image import QwenImageDecoder, QwenImageDenoiser, QwenImageTextEncoder

    d = qwen_image_tiny_dir
    pipe = QwenImagePipeline.from_pretrained(d).to(DEVICE)
    pipe.set_progress_bar_config(disable=True)
    check_batched_at_different_timesteps(
        pipe, QwenImageTextEncoder(d, device=DEVICE), QwenImageDenoiser(d, device=DEVICE),
        QwenImageDecoder(d, device=DEVICE), atol=DEVICE_LATENT_ATOL)
