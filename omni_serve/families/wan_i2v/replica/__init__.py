"""Replica-side code of the Wan image-to-video graph: stage runners and the programs the diffusion kit's do not
cover.

Imported only by the stage replicas (and in-process graphs); the ingress never loads it.
"""
