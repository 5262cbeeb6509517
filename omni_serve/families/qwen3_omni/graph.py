"""The Qwen3-Omni graph, declared once: encoder -> thinker -> talker -> code2wav, in two thinker layouts.

As Qwen2.5-Omni's (``omni_serve.families.qwen2_5_omni.graph``): ``aggregated`` deploys one ``thinker`` stage;
``disaggregated`` deploys ``thinker_prefill`` (the prompt's KV, handed over ``thinker_prefill_thinker_decode``)
and ``thinker_decode``. The thinker is a mixture of experts with deepstack visual features; the talker runs its
code predictor (the residual codebooks of every frame) batched across the requests of each step; code2wav is
the causal ConvNet vocoder, streamed chunk by chunk.
"""

from __future__ import annotations

from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from omni_serve.families.qwen3_omni import messages as M
from omni_serve.families.qwen3_omni.params import (
    Code2WavStage, EncoderStage, ExpertParallelThinkerStage, TalkerStage, ThinkerPrefillStage, ThinkerStage,
)

KIT_RUNNERS = "omni_serve.kits.omni.replica.runners"
RUNNERS = "omni_serve.families.qwen3_omni.replica.runners"
ADAPTERS = "omni_serve.models.qwen3_omni"
AGGREGATED, DISAGGREGATED = "aggregated", "disaggregated"

GRAPH = GraphDef(
    name="qwen3_omni",
    layouts=(AGGREGATED, DISAGGREGATED),
    ingress_writes=("ingress_encoder",),
    stages=(
        StageDef("encoder", "Audio + vision towers (with the deepstack features).", f"{KIT_RUNNERS}:EncoderRunner",
                 EngineKind.STEP, f"{ADAPTERS}:Qwen3OmniEncoder", call=M.EncoderCall, reads=("ingress_encoder",),
                 writes=("encoder_thinker",), spec=EncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("thinker", "MoE text decoder (autoregressive): prompt and generation. Deployed in the aggregated "
                 "thinker layout.", f"{RUNNERS}:ThinkerRunner", EngineKind.AR, f"{ADAPTERS}:Qwen3OmniThinker",
                 call=M.ThinkerCall, outputs=(M.TextDelta,), reads=("encoder_thinker",), writes=("thinker_talker",),
                 spec=ExpertParallelThinkerStage, layouts=(AGGREGATED,)),
        StageDef("thinker_prefill", "Disaggregated thinker layout: computes each prompt's KV cache and hands it to "
                 "thinker_decode; never generates.", f"{RUNNERS}:ThinkerPrefillRunner", EngineKind.AR,
                 f"{ADAPTERS}:Qwen3OmniThinker", call=M.ThinkerCall, outputs=(M.PrefillDone,),
                 reads=("encoder_thinker",), writes=("thinker_prefill_thinker_decode",), spec=ThinkerPrefillStage,
                 defaults={"num_cpus": 0.25}, layouts=(DISAGGREGATED,)),
        StageDef("thinker_decode", "Disaggregated thinker layout: adopts prefilled prompts and generates text and "
                 "the talker's inputs. Its params are the text-generation settings in that layout.",
                 f"{RUNNERS}:ThinkerDecodeRunner", EngineKind.AR, f"{ADAPTERS}:Qwen3OmniThinker",
                 call=M.ThinkerCall, outputs=(M.TextDelta,), reads=("thinker_prefill_thinker_decode",),
                 writes=("thinker_talker",), spec=ThinkerStage, layouts=(DISAGGREGATED,)),
        StageDef("talker", "MoE codec decoder (autoregressive, first codebook) with its code predictor (the "
                 "residual codebooks of each frame, batched across requests).", f"{RUNNERS}:TalkerRunner",
                 EngineKind.AR, f"{ADAPTERS}:Qwen3OmniTalker", call=M.TalkerCall, outputs=(M.CodecDelta,),
                 reads=("thinker_talker",), writes=("talker_code2wav",), spec=TalkerStage),
        StageDef("code2wav", "Causal ConvNet vocoder, streamed chunk by chunk.", f"{RUNNERS}:Code2WavRunner",
                 EngineKind.BATCH, f"{ADAPTERS}:Qwen3OmniCode2Wav", call=M.Code2WavCall, outputs=(M.AudioDelta,),
                 reads=("talker_code2wav",), spec=Code2WavStage, defaults={"num_cpus": 0.25}),
    ),
    edges=(
        EdgeDef("ingress_encoder", M.MediaInputs, "The request's preprocessed media (audio features, image "
                "patches) to the encoder."),
        EdgeDef("encoder_thinker", M.MediaEmbeddings, "Media embeddings (images with their deepstack features) to "
                "the thinker."),
        EdgeDef("thinker_prefill_thinker_decode", M.PromptHandoff, "Disaggregated thinker layout: one prompt "
                "hand-off per request (prompt KV, rows, last logits, the talker's prompt vectors) from "
                "thinker_prefill to thinker_decode; chunk sizes do not apply."),
        EdgeDef("thinker_talker", M.ThinkerStates, "The talker's prompt, then the generated tokens' embeddings "
                "(chunk = generated tokens; the talker reads one per frame, so small chunks keep it going).",
                stream=True, defaults={"chunk_size": 4, "first_chunk_size": 2}),
        EdgeDef("talker_code2wav", M.CodecChunk, "Codec frames to code2wav (chunk = frames).", stream=True,
                defaults={"chunk_size": 4, "first_chunk_size": 2}),
    ),
)
