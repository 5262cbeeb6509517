"""The GLM-Image graph, declared once: an autoregressive model writes the image's visual tokens, a DiT denoises
conditioned on them (and on the glyphs of the prompt's quoted text), the VAE decodes.

    ingress -> ar ----------> dit -> vae
    ingress -> text_encoder -> dit

The AR stage and the glyph encoder run side by side; the DiT starts once both have written their payload.
The glyph encoder (diffusers' ``text_encoder``, a T5 over quoted text) runs the diffusion kit's runner and program.
"""

from __future__ import annotations

from omni_serve.families.glm_image import messages as M
from omni_serve.families.glm_image.params import ARStage, DiTStage, TextEncoderStage, VAEStage
from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef

RUNNERS = "omni_serve.families.glm_image.replica.runners"
ADAPTERS = "omni_serve.models.glm_image"

GRAPH = GraphDef(
    name="glm_image",
    stages=(
        StageDef("ar", "Prompt -> visual tokens (GlmImageForConditionalGeneration's decoder), continuous batching "
                 "over a paged KV cache.", f"{RUNNERS}:PriorRunner", EngineKind.AR, f"{ADAPTERS}:GlmImageAR",
                 call=M.PriorCall, outputs=(M.PriorDone,), writes=("ar_dit",), spec=ARStage,
                 # The AR samples every token and a seed must draw what the pipeline draws: prepacked linear layers
                 # change the logits' last bits, which flipped 1 draw in 32 at batch 1 (docs/glm_image.md). On, the
                 # AR is ~19% faster at batch 8.
                 defaults={"num_cpus": 0.5, "engine": {"ar": {"packed_linear": False}}}),
        StageDef("text_encoder", "Quoted text of the prompt -> glyph embeddings (T5).",
                 "omni_serve.kits.diffusion.replica.runners:TextEncoderRunner", EngineKind.BATCH,
                 f"{ADAPTERS}:GlmImageGlyphEncoder", call=M.TextEncodeCall, outputs=(M.PromptEncoded,),
                 writes=("text_encoder_dit",), spec=TextEncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("dit", "Denoising loop (GlmImageTransformer2DModel) conditioned on the visual tokens, step-level "
                 "batching.", f"{RUNNERS}:DiTRunner", EngineKind.BATCH, f"{ADAPTERS}:GlmImageDenoiser",
                 call=M.GlmDenoiseCall, outputs=(M.DenoiseDone,), reads=("text_encoder_dit", "ar_dit"),
                 writes=("dit_vae",), spec=DiTStage, defaults={"num_cpus": 0.75, "engine": {"torch_threads": 2}}),
        StageDef("vae", "Latents -> pixels.", f"{RUNNERS}:VAERunner", EngineKind.BATCH,
                 f"{ADAPTERS}:GlmImageDecoder", call=M.DecodeCall, outputs=(M.ImagesEncoded,),
                 reads=("dit_vae",), spec=VAEStage, defaults={"num_cpus": 0.25}),
    ),
    edges=(
        EdgeDef("ar_dit", M.PriorTokens, "The visual tokens (upsampled to the DiT's grid) to the DiT."),
        EdgeDef("text_encoder_dit", M.PromptEmbeds, "Glyph embeddings (and those of \"\" under CFG) to the DiT."),
        EdgeDef("dit_vae", M.FinalLatents, "Final latents to the VAE."),
    ),
)
