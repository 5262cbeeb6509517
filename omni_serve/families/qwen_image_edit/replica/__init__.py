"""Replica-side code of the Qwen-Image-Edit graph: stage runners and the programs Qwen-Image's do not cover.

Imported only by the stage replicas (and in-process graphs); the ingress never loads it.
"""
