"""A graph's ``data_plane`` field: one section per connector, validated by that connector's own settings model.

Contract: a graph spec has ``data_plane: DataPlaneSpec``. Each key is a section some registered connector
reads (``omni_serve.transport.registry``): its ``settings_section``, or else the name it is registered under
(``data_plane.shm``, ``data_plane.mooncake``: also read by ``mooncake_store``, or a plug-in's own); the value is
validated by that connector's ``Settings`` model, so a plug-in connector takes settings with no change here.
Any other key fails, naming the known connectors. Validating a section imports its connector's module.
``section(name)`` is the settings a connector is built with (``omni_serve.transport.connectors.get_connector``):
the validated section, or the model's defaults when the spec leaves it out. Which edge uses which backend is
the edge's ``connector`` field, not this.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from omni_serve.transport.base import Connector
from omni_serve.transport.registry import connector_class


def _section_of(cls: type[Connector], name: str) -> str:
    return cls.settings_section or name


def _settings_model(key: str) -> type[BaseModel]:
    """The model of the ``data_plane.<key>`` section (``ValueError`` when no connector reads that section)."""
    cls = connector_class(key)
    if cls.Settings is None:
        raise ValueError(f"connector {key!r} takes no settings")
    if _section_of(cls, key) != key:
        raise ValueError(f"connector {key!r} reads its settings from data_plane.{_section_of(cls, key)}")
    return cls.Settings


class DataPlaneSpec(BaseModel):
    """Settings of the data-plane connectors: ``data_plane.<connector>.<field>``."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        """Each section validated by its connector's ``Settings``; errors located at ``<section>.<field>``."""
        if not isinstance(data, dict):
            return data
        sections: dict[str, BaseModel] = {}
        errors: list[InitErrorDetails] = []
        for key, value in data.items():
            try:
                sections[key] = _settings_model(key).model_validate(value)
            except ValidationError as exc:
                errors += [InitErrorDetails(type=e["type"], loc=(key, *e["loc"]), input=e["input"],
                                            ctx=e.get("ctx", {})) for e in exc.errors()]
            except ValueError as exc:
                errors.append(InitErrorDetails(type="value_error", loc=(key,), input=value, ctx={"error": exc}))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return sections

    def section(self, connector: str) -> BaseModel | None:
        """The settings ``connector`` (a registered name) is built with: its section, or its ``Settings``'
        defaults; None for a connector without settings."""
        cls = connector_class(connector)
        if cls.Settings is None:
            return None
        given = (self.model_extra or {}).get(_section_of(cls, connector))
        return given if given is not None else cls.Settings()
