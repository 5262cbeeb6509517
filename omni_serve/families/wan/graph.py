"""The Wan text-to-video graph, declared once: text_encoder -> dit -> vae."""

from __future__ import annotations

from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from omni_serve.kits.diffusion import messages as M
from omni_serve.kits.diffusion.params import TextEncoderStage, VideoDiTStage, VideoVAEStage

RUNNERS = "omni_serve.kits.diffusion.replica.runners"
ADAPTERS = "omni_serve.models.wan"

GRAPH = GraphDef(
    name="wan",
    stages=(
        StageDef("text_encoder", "Prompt -> embeddings (UMT5).", f"{RUNNERS}:TextEncoderRunner", EngineKind.BATCH,
                 f"{ADAPTERS}:WanTextEncoder", call=M.TextEncodeCall, outputs=(M.PromptEncoded,),
                 writes=("text_encoder_dit",), spec=TextEncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("dit", "Denoising loop (WanTransformer3DModel), step-level batching across videos of one shape.",
                 f"{RUNNERS}:VideoDiTRunner", EngineKind.BATCH, f"{ADAPTERS}:WanDenoiser", call=M.VideoDenoiseCall,
                 outputs=(M.DenoiseProgress, M.DenoiseDone), reads=("text_encoder_dit",), writes=("dit_vae",),
                 spec=VideoDiTStage, defaults={"num_cpus": 1.0, "engine": {"torch_threads": 2}}),
        StageDef("vae", "Latents -> frames -> MP4 (Wan's 3D VAE, H.264).", f"{RUNNERS}:VideoVAERunner",
                 EngineKind.BATCH, f"{ADAPTERS}:WanDecoder", call=M.VideoDecodeCall, outputs=(M.VideosEncoded,),
                 reads=("dit_vae",), spec=VideoVAEStage, defaults={"num_cpus": 0.5}),
    ),
    edges=(
        EdgeDef("text_encoder_dit", M.PromptEmbeds, "Prompt embeddings to the DiT."),
        EdgeDef("dit_vae", M.FinalLatents, "Final video latents to the VAE."),
    ),
)
