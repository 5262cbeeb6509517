"""The Qwen2.5-Omni graph, declared once: encoder -> thinker -> talker -> code2wav, in two thinker layouts.

``aggregated`` deploys one ``thinker`` stage (prompt and generation); ``disaggregated`` deploys
``thinker_prefill`` (computes the prompt's KV, hands it over ``thinker_prefill_thinker_decode``) and
``thinker_decode`` (adopts it and generates). The same thinker code runs in all three roles.
``aggregated_vllm`` is the aggregated layout with the thinker on vLLM (``stages.thinker.engine.backend: vllm``,
runner ``replica/vllm_thinker.py``): vLLM runs the audio and vision towers itself (it computes the multimodal
positions from the raw media), so no encoder stage is deployed and the ingress writes the decoded media on
``ingress_thinker``.
"""

from __future__ import annotations

from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from omni_serve.families.qwen2_5_omni import messages as M
from omni_serve.families.qwen2_5_omni.params import (
    Code2WavStage, EncoderStage, TalkerStage, TensorParallelThinkerStage, ThinkerPrefillStage, ThinkerStage,
)

KIT_RUNNERS = "omni_serve.kits.omni.replica.runners"
RUNNERS = "omni_serve.families.qwen2_5_omni.replica.runners"
ADAPTERS = "omni_serve.models.qwen2_5_omni"
VLLM_RUNNERS = "omni_serve.families.qwen2_5_omni.replica.vllm_thinker"
AGGREGATED, DISAGGREGATED, AGGREGATED_VLLM = "aggregated", "disaggregated", "aggregated_vllm"
NATIVE_LAYOUTS = (AGGREGATED, DISAGGREGATED)

GRAPH = GraphDef(
    name="qwen2_5_omni",
    layouts=(AGGREGATED, DISAGGREGATED, AGGREGATED_VLLM),
    ingress_writes=("ingress_encoder", "ingress_thinker"),
    stages=(
        StageDef("encoder", "Audio + vision towers.", f"{KIT_RUNNERS}:EncoderRunner", EngineKind.STEP,
                 f"{ADAPTERS}:OmniEncoder", call=M.EncoderCall, reads=("ingress_encoder",),
                 writes=("encoder_thinker",), spec=EncoderStage, defaults={"num_cpus": 0.25}, layouts=NATIVE_LAYOUTS),
        StageDef("thinker", "Text decoder (autoregressive): prompt and generation. Deployed in the aggregated "
                 "thinker layout; engine.backend 'vllm' runs it (and its media towers) on vLLM.",
                 f"{RUNNERS}:ThinkerRunner", EngineKind.AR, f"{ADAPTERS}:OmniThinker",
                 call=M.ThinkerCall, outputs=(M.TextDelta,), reads=("encoder_thinker", "ingress_thinker"),
                 writes=("thinker_talker",), spec=TensorParallelThinkerStage, layouts=(AGGREGATED, AGGREGATED_VLLM),
                 backends={"vllm": f"{VLLM_RUNNERS}:VllmThinkerRunner"}),
        StageDef("thinker_prefill", "Disaggregated thinker layout: computes each prompt's KV cache (media "
                 "embeddings from the encoder) and hands it to thinker_decode; never generates.",
                 f"{RUNNERS}:ThinkerPrefillRunner", EngineKind.AR, f"{ADAPTERS}:OmniThinker", call=M.ThinkerCall,
                 outputs=(M.PrefillDone,), reads=("encoder_thinker",), writes=("thinker_prefill_thinker_decode",),
                 spec=ThinkerPrefillStage, defaults={"num_cpus": 0.25}, layouts=(DISAGGREGATED,)),
        StageDef("thinker_decode", "Disaggregated thinker layout: adopts prefilled prompts and generates text and "
                 "talker states. Its params are the text-generation settings in that layout.",
                 f"{RUNNERS}:ThinkerDecodeRunner", EngineKind.AR, f"{ADAPTERS}:OmniThinker", call=M.ThinkerCall,
                 outputs=(M.TextDelta,), reads=("thinker_prefill_thinker_decode",), writes=("thinker_talker",),
                 spec=ThinkerStage, layouts=(DISAGGREGATED,)),
        StageDef("talker", "Codec decoder (autoregressive).", f"{RUNNERS}:TalkerRunner", EngineKind.AR,
                 f"{ADAPTERS}:OmniTalker", call=M.TalkerCall, outputs=(M.CodecDelta,), reads=("thinker_talker",),
                 writes=("talker_code2wav",), spec=TalkerStage),
        StageDef("code2wav", "DiT + BigVGAN vocoder.", f"{RUNNERS}:Code2WavRunner", EngineKind.BATCH,
                 f"{ADAPTERS}:OmniCode2Wav", call=M.Code2WavCall, outputs=(M.AudioDelta,),
                 reads=("talker_code2wav",), spec=Code2WavStage, defaults={"num_cpus": 0.25}),
    ),
    edges=(
        EdgeDef("ingress_encoder", M.MediaInputs, "The request's preprocessed media (audio features, image "
                "patches) to the encoder.", layouts=NATIVE_LAYOUTS),
        EdgeDef("encoder_thinker", M.MediaEmbeddings, "Media embeddings to the thinker.", layouts=NATIVE_LAYOUTS),
        EdgeDef("ingress_thinker", M.RawMedia, "Thinker on vLLM: the request's decoded media (16 kHz audio, RGB "
                "images), which vLLM preprocesses and encodes itself.", layouts=(AGGREGATED_VLLM,)),
        EdgeDef("thinker_prefill_thinker_decode", M.PromptHandoff, "Disaggregated thinker layout: one prompt "
                "hand-off per request (prompt KV, embeddings, last logits, prompt states) from thinker_prefill to "
                "thinker_decode; chunk sizes do not apply."),
        EdgeDef("thinker_talker", M.ThinkerStates, "Thinker states to the talker (chunk = generated tokens).",
                stream=True, defaults={"chunk_size": 8, "first_chunk_size": 1}),
        EdgeDef("talker_code2wav", M.CodecChunk, "Codec tokens to code2wav (the first chunk covers code2wav's "
                "first audio chunk and its right context).", stream=True,
                defaults={"chunk_size": 12, "first_chunk_size": 24}),
    ),
)
