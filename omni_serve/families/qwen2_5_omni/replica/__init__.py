"""Replica-side code of the Qwen2.5-Omni graph: stage runners, per-request programs, streaming code2wav.

Imported only by the stage replicas (and in-process graphs); the ingress never loads it.
"""
