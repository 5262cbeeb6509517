"""Replica-side code of the diffusion kit: stage runners, per-request programs, cache-dit sessions.

Imported only by the stage replicas (and in-process graphs); the ingress never loads it.
"""
