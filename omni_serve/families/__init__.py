"""The model families this repository ships, one package each (``omni_serve.families.<name>``).

A family package declares ``FAMILY`` (``omni_serve.graph.family.Family``): its graph, spec, frontend and checkpoint
writer. The registry (``omni_serve.graph.registry``) finds every package here; a family outside the repository
plugs in through the ``omni_serve.families`` entry-point group instead. A family imports the framework
(``omni_serve.graph``), the deployments and the shared kits (``omni_serve.kits``), never another family.
"""
