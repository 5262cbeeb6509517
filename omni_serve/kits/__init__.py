"""Shared kits: what several families build on, so that no family imports another.

A kit (``omni_serve.kits.<kit>``) holds the messages, stage sections, request checks and replica-side programs
and runners that a group of families share. Kits sit between the families and the deployments in the layer
order: a kit imports the framework (``omni_serve.graph``), the model adapters and the engines, never a family
and never another kit. As in a family, only a kit's ``replica/`` package imports replica code.
"""
