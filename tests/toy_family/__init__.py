"""A family written outside ``omni_serve``, the way a new one is added: this package only (plus its model adapter
and checkpoint writer, which live in it too), registered through the ``omni_serve.families`` entry point.

``toy`` echoes a text through two stages: ``encode`` embeds its characters with the checkpoint's embedding table
and writes the rows on the ``encode_decode`` edge; ``decode`` maps each row back to the nearest row of the table
and answers the text. It imports the framework (``omni_serve.graph``), the engines and the deployments, never a
shipped family (``tests/unit/test_toy_family.py``).
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.graph.family import Family
from tests.toy_family.graph import GRAPH
from tests.toy_family.spec import ToySpec

FAMILY = Family(module=__name__, description="A toy plug-in: text echoed through two stages.",
                graph=GRAPH, spec=ToySpec, frontend="tests.toy_family.frontend:ToyFrontend",
                checkpoint_marker="toy.json", checkpoint_writer="tests.toy_family.model:make_checkpoint")

build_app = serve_builder(FAMILY)
