"""The Qwen-Image-Edit graph, declared once: the input image reaches the prompt encoder (Qwen2.5-VL's vision tower)
and the VAE encoder, whose latents condition every DiT step; the VAE decodes the result.

    ingress -> text_encoder -> dit -> vae
    ingress -> vae_encoder  -> dit
    ingress ------------------> dit   (inpainting: the mask)

The DiT and VAE decoder run the diffusion kit's code (its adapters; the VAE stage is the diffusion kit's runner).
"""

from __future__ import annotations

from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from omni_serve.families.qwen_image_edit import messages as M
from omni_serve.families.qwen_image_edit.params import DiTStage, TextEncoderStage, VAEEncoderStage, VAEStage

RUNNERS = "omni_serve.families.qwen_image_edit.replica.runners"
ADAPTERS = "omni_serve.models.qwen_image_edit"
IMAGE_ADAPTERS = "omni_serve.models.qwen_image"

GRAPH = GraphDef(
    name="qwen_image_edit",
    ingress_writes=("ingress_text_encoder", "ingress_vae_encoder", "ingress_dit"),
    stages=(
        StageDef("text_encoder", "Prompt + input image -> embeddings (Qwen2.5-VL, its vision tower reading the "
                 "image).", f"{RUNNERS}:EditTextEncoderRunner", EngineKind.BATCH,
                 f"{ADAPTERS}:QwenImageEditTextEncoder", call=M.TextEncodeCall, outputs=(M.PromptEncoded,),
                 reads=("ingress_text_encoder",), writes=("text_encoder_dit",), spec=TextEncoderStage,
                 defaults={"num_cpus": 0.25}),
        StageDef("vae_encoder", "Input image -> conditioning latents (the VAE's encoder).",
                 f"{RUNNERS}:ConditionEncoderRunner", EngineKind.BATCH, f"{ADAPTERS}:QwenImageConditionEncoder",
                 call=M.EncodeImageCall, reads=("ingress_vae_encoder",), writes=("vae_encoder_dit",),
                 spec=VAEEncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("dit", "Denoising loop conditioned on the image latents (QwenImageTransformer2DModel), step-level "
                 "batching.", f"{RUNNERS}:EditDiTRunner", EngineKind.BATCH, f"{IMAGE_ADAPTERS}:QwenImageDenoiser",
                 call=M.EditDenoiseCall, outputs=(M.DenoiseDone,),
                 reads=("text_encoder_dit", "vae_encoder_dit", "ingress_dit"),
                 writes=("dit_vae",), spec=DiTStage, defaults={"num_cpus": 0.75, "engine": {"torch_threads": 2}}),
        StageDef("vae", "Latents -> pixels.", "omni_serve.kits.diffusion.replica.runners:VAERunner",
                 EngineKind.BATCH, f"{IMAGE_ADAPTERS}:QwenImageDecoder", call=M.DecodeCall,
                 outputs=(M.ImagesEncoded,), reads=("dit_vae",), spec=VAEStage, defaults={"num_cpus": 0.25}),
    ),
    edges=(
        EdgeDef("ingress_text_encoder", M.InputImage, "The input image (at its conditioning size) to the prompt "
                "encoder."),
        EdgeDef("ingress_vae_encoder", M.InputImage, "The input image (at its conditioning size) to the VAE "
                "encoder."),
        EdgeDef("ingress_dit", M.InpaintMask, "Inpainting (an edit with a mask): the binarized mask to the DiT."),
        EdgeDef("text_encoder_dit", M.PromptEmbeds, "Prompt embeddings to the DiT."),
        EdgeDef("vae_encoder_dit", M.ConditionLatents, "The input image's latents to the DiT."),
        EdgeDef("dit_vae", M.FinalLatents, "Final latents to the VAE."),
    ),
)
