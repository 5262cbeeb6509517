"""A model family as one plug-in: its graph, spec, frontend and checkpoint writer, named in one object.

Contract: a family package (``omni_serve/families/<family>/__init__.py``, or any package named by an
``omni_serve.families`` entry point) defines ``FAMILY = Family(...)`` (its name is its graph's) and a Serve builder
``build_app = serve_builder(FAMILY)`` (``omni_serve.deployments.entry``; ``serve run <package>:build_app
checkpoint=DIR``). Importing the package must not import torch or model code: the registry
(``omni_serve.graph.registry``), the CLI and the Serve config writer import every family to list and validate them.

``validate(args)`` turns user values (a dict; dotted keys allowed, as ``serve run ... key=value`` passes them)
into the family's spec, with the checkpoint path made absolute after checking it is a checkpoint directory, and
(``served=True``, the default: a deployed graph, whose stages are separate processes) every edge's connector
able to cross processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from omni_serve.graph.graph import GraphDef
from omni_serve.graph.spec import GraphSpecBase, apply_overrides


@dataclass(frozen=True, eq=False)
class Family:
    module: str  # the family package (``__name__``): FAMILY and build_app live there
    description: str
    graph: GraphDef
    spec: type[GraphSpecBase]
    frontend: str  # module:Class of the ingress-side Frontend
    checkpoint_marker: str  # a file every checkpoint directory of the family has
    checkpoint_writer: str | None = None  # module:function(out_dir, size, seed) for tiny/small random checkpoints
    sizing: str | None = None  # module:function(spec, ClusterShape) -> defaults sized to the cluster (graph.sizing)
    name: str = ""  # CLI name and Serve application name, e.g. "qwen2_5_omni": the graph's name (the default)

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.graph.name)
        if self.name != self.graph.name:
            raise ValueError(f"family {self.name!r} declares the graph {self.graph.name!r}: give both one name")

    @property
    def path(self) -> str:
        """Import path of this object (what deployments are given to find the family)."""
        return f"{self.module}:FAMILY"

    @property
    def app(self) -> str:
        """Serve import path of the family's builder."""
        return f"{self.module}:build_app"

    def checkpoint_hint(self) -> str:
        if self.checkpoint_writer is None:
            return f"give a {self.name} checkpoint directory"
        return f"write one with `omni-serve make-checkpoint {self.name} --size tiny DIR`"

    def validate(self, args: dict[str, Any] | None, served: bool = True) -> GraphSpecBase:
        spec = self.parse(args, served)
        checkpoint = os.path.abspath(os.path.expanduser(spec.checkpoint))
        if not os.path.isfile(os.path.join(checkpoint, self.checkpoint_marker)):
            raise ValueError(f"checkpoint {spec.checkpoint!r} is not a checkpoint directory (no "
                             f"{self.checkpoint_marker}); {self.checkpoint_hint()}")
        return spec.model_copy(update={"checkpoint": checkpoint})

    def resolve_connectors(self, spec: GraphSpecBase) -> GraphSpecBase:
        """``spec`` with every ``auto`` edge naming the backend this process chose for it
        (``omni_serve.transport.auto``): the Serve builder hands all replicas the same concrete backends. Unchanged
        when this process cannot see the cluster."""
        from omni_serve.transport.auto import AUTO, can_choose_for_cluster, resolve

        if not can_choose_for_cluster():  # no Ray here: each replica chooses, seeing the cluster
            return spec
        updates = {}
        for name in type(spec.edges).model_fields:
            edge = getattr(spec.edges, name)
            if edge.connector == AUTO:
                updates[name] = edge.model_copy(update={"connector": resolve(AUTO, spec.data_plane)})
        if not updates:
            return spec
        return spec.model_copy(update={"edges": spec.edges.model_copy(update=updates)})

    def parse(self, args: dict[str, Any] | None, served: bool = True) -> GraphSpecBase:
        """The spec of ``args`` (the checkpoint unchecked: it may exist only where the graph is deployed)."""
        spec = self.spec.model_validate(apply_overrides(dict(args or {})))
        for stage in self.graph.deployed(spec.layout()):
            stage.runner_for(spec.stage_spec(stage.name).engine.backend)  # ValueError: no such backend
        if served:
            self._check_connectors(spec)
        return spec

    def _check_connectors(self, spec: GraphSpecBase) -> None:
        """A served graph's stages are separate processes: an in-process connector cannot carry an edge."""
        from omni_serve.transport.registry import AUTO, connector_class, served_connectors

        for link in self.graph.links(spec.layout()):
            name = spec.edge_spec(link.edge).connector
            if name != AUTO and connector_class(name).scope == "process":  # auto is never in-process
                raise ValueError(f"edges.{link.edge}.connector={name!r} works inside one process only; a served "
                                 f"graph's stages are separate processes (use {AUTO} or one of "
                                 f"{', '.join(served_connectors())})")
