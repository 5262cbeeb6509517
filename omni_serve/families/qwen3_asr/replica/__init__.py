"""Replica-side code of the Qwen3-ASR graph (loads model code: never imported by the ingress)."""
