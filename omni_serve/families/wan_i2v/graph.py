"""The Wan image-to-video graph, declared once: the first frame reaches the CLIP image encoder and the VAE encoder,
whose outputs condition every DiT step beside the prompt's; the VAE decodes the result.

    ingress -> image_encoder -> dit -> vae
    ingress -> vae_encoder   -> dit
               text_encoder  -> dit

The text encoder, DiT and VAE decoder run the diffusion kit's code on Wan's adapters.
"""

from __future__ import annotations

from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from omni_serve.families.wan_i2v import messages as M
from omni_serve.families.wan_i2v.params import FirstFrameEncoderStage, ImageEncoderStage
from omni_serve.kits.diffusion.params import TextEncoderStage, VideoDiTStage, VideoVAEStage

KIT = "omni_serve.kits.diffusion.replica.runners"
RUNNERS = "omni_serve.families.wan_i2v.replica.runners"
ADAPTERS = "omni_serve.models.wan"
I2V_ADAPTERS = "omni_serve.models.wan_i2v"

GRAPH = GraphDef(
    name="wan_i2v",
    ingress_writes=("ingress_image_encoder", "ingress_vae_encoder"),
    stages=(
        StageDef("text_encoder", "Prompt -> embeddings (UMT5).", f"{KIT}:TextEncoderRunner", EngineKind.BATCH,
                 f"{ADAPTERS}:WanTextEncoder", call=M.TextEncodeCall, outputs=(M.PromptEncoded,),
                 writes=("text_encoder_dit",), spec=TextEncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("image_encoder", "First frame -> image tokens (CLIP vision tower).",
                 f"{RUNNERS}:ImageEncoderRunner", EngineKind.BATCH, f"{I2V_ADAPTERS}:WanImageEncoder",
                 call=M.EncodeImageCall, reads=("ingress_image_encoder",), writes=("image_encoder_dit",),
                 spec=ImageEncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("vae_encoder", "First frame and black frames -> conditioning latents (Wan's 3D VAE encoder).",
                 f"{RUNNERS}:FirstFrameEncoderRunner", EngineKind.BATCH, f"{I2V_ADAPTERS}:WanConditionEncoder",
                 call=M.EncodeFirstFrameCall, reads=("ingress_vae_encoder",), writes=("vae_encoder_dit",),
                 spec=FirstFrameEncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("dit", "Denoising loop conditioned on the first frame (WanTransformer3DModel), step-level "
                 "batching across videos of one shape.", f"{RUNNERS}:ImageToVideoDiTRunner", EngineKind.BATCH,
                 f"{ADAPTERS}:WanDenoiser", call=M.VideoDenoiseCall, outputs=(M.DenoiseProgress, M.DenoiseDone),
                 reads=("text_encoder_dit", "image_encoder_dit", "vae_encoder_dit"), writes=("dit_vae",),
                 spec=VideoDiTStage, defaults={"num_cpus": 0.75, "engine": {"torch_threads": 2}}),
        StageDef("vae", "Latents -> frames -> MP4 (Wan's 3D VAE, H.264).", f"{KIT}:VideoVAERunner",
                 EngineKind.BATCH, f"{ADAPTERS}:WanDecoder", call=M.VideoDecodeCall, outputs=(M.VideosEncoded,),
                 reads=("dit_vae",), spec=VideoVAEStage, defaults={"num_cpus": 0.25}),
    ),
    edges=(
        EdgeDef("ingress_image_encoder", M.InputImage, "The first frame to the image encoder."),
        EdgeDef("ingress_vae_encoder", M.InputImage, "The first frame to the VAE encoder."),
        EdgeDef("text_encoder_dit", M.PromptEmbeds, "Prompt embeddings to the DiT."),
        EdgeDef("image_encoder_dit", M.ImageEmbeds, "The first frame's image tokens to the DiT."),
        EdgeDef("vae_encoder_dit", M.FirstFrameLatents, "The first frame's conditioning latents to the DiT."),
        EdgeDef("dit_vae", M.FinalLatents, "Final video latents to the VAE."),
    ),
)
