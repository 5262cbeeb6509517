"""The Qwen-Image graph, declared once: text_encoder -> dit -> vae."""

from __future__ import annotations

from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from omni_serve.kits.diffusion import messages as M
from omni_serve.kits.diffusion.params import DiTStage, TextEncoderStage, VAEStage

RUNNERS = "omni_serve.kits.diffusion.replica.runners"
ADAPTERS = "omni_serve.models.qwen_image"

GRAPH = GraphDef(
    name="qwen_image",
    stages=(
        StageDef("text_encoder", "Prompt -> embeddings (Qwen2.5-VL).", f"{RUNNERS}:TextEncoderRunner",
                 EngineKind.BATCH, f"{ADAPTERS}:QwenImageTextEncoder", call=M.TextEncodeCall,
                 outputs=(M.PromptEncoded,), writes=("text_encoder_dit",), spec=TextEncoderStage,
                 defaults={"num_cpus": 0.25}),
        StageDef("dit", "Denoising loop (QwenImageTransformer2DModel), step-level batching.",
                 f"{RUNNERS}:DiTRunner", EngineKind.BATCH, f"{ADAPTERS}:QwenImageDenoiser", call=M.DenoiseCall,
                 outputs=(M.DenoiseDone,), reads=("text_encoder_dit",), writes=("dit_vae",), spec=DiTStage,
                 defaults={"num_cpus": 1.0, "engine": {"torch_threads": 2}}),
        StageDef("vae", "Latents -> pixels.", f"{RUNNERS}:VAERunner", EngineKind.BATCH,
                 f"{ADAPTERS}:QwenImageDecoder", call=M.DecodeCall, outputs=(M.ImagesEncoded,),
                 reads=("dit_vae",), spec=VAEStage, defaults={"num_cpus": 0.25}),
    ),
    edges=(
        EdgeDef("text_encoder_dit", M.PromptEmbeds, "Prompt embeddings to the DiT."),
        EdgeDef("dit_vae", M.FinalLatents, "Final latents to the VAE."),
    ),
)
