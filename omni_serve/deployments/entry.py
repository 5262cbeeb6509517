"""A family's Serve entry point, in one line of its package: ``build_app = serve_builder(FAMILY)``.

Contract: ``serve_builder(family)`` returns ``build_app(args)``, what ``serve run <package>:build_app key=value``
and Serve config files (``applications[].import_path``) call: it validates ``args`` against the family's spec and
returns the graph's Serve application (``omni_serve.deployments.builder.build_app``). Importing this module
imports neither Ray nor model code (family packages are imported to list and validate them); the builder is
imported when an application is built.
"""

from __future__ import annotations

from typing import Any, Callable

from omni_serve.graph.family import Family


def serve_builder(family: Family) -> Callable[[dict[str, Any] | None], Any]:
    def build_app(args: dict[str, Any] | None = None):
        from omni_serve.deployments.builder import build_app as build

        return build(family, args)

    build_app.__doc__ = f"The {family.name} graph as a Serve application (``args``: its spec's values)."
    build_app.__module__ = family.module
    return build_app
