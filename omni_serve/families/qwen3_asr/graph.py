"""The Qwen3-ASR graph, declared once: the audio encoder turns each window's log-mel into audio embeddings, the
LLM decodes the transcript with them in its prompt.

    ingress -> encoder -> llm

The ingress decodes the upload, splits long audio into windows and computes each window's features (the
processor's own, per window); each window is one request on both stages, so windows of one upload and of other
uploads share the encoder's calls and the LLM's steps.
"""

from __future__ import annotations

from omni_serve.families.qwen3_asr import messages as M
from omni_serve.families.qwen3_asr.params import EncoderStage, LLMStage
from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef

RUNNERS = "omni_serve.families.qwen3_asr.replica.runners"
ADAPTERS = "omni_serve.models.qwen3_asr"

GRAPH = GraphDef(
    name="qwen3_asr",
    stages=(
        StageDef("encoder", "Log-mel -> audio embeddings (audio tower + projector), windows of any requests and "
                 "lengths in one call.", f"{RUNNERS}:EncoderRunner", EngineKind.BATCH, f"{ADAPTERS}:Qwen3ASREncoder",
                 call=M.EncodeCall, outputs=(M.AudioEncoded,), reads=("ingress_encoder",),
                 writes=("encoder_llm",), spec=EncoderStage, defaults={"num_cpus": 0.25}),
        StageDef("llm", "Prompt with the audio embeddings -> transcript tokens (Qwen3 decoder), continuous "
                 "batching over a paged KV cache.", f"{RUNNERS}:LLMRunner", EngineKind.AR,
                 f"{ADAPTERS}:Qwen3ASRLM", call=M.TranscribeCall, outputs=(M.TranscriptTokens, M.TranscribeDone),
                 reads=("encoder_llm",), spec=LLMStage, defaults={"num_cpus": 0.5}),
    ),
    edges=(
        EdgeDef("ingress_encoder", M.AudioFeatures, "A window's log-mel features (and valid frames) to the encoder."),
        EdgeDef("encoder_llm", M.AudioEmbeds, "A window's audio embeddings to the LLM."),
    ),
    ingress_writes=("ingress_encoder",),
)
