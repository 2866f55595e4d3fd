"""One base for the typed JSON columns (incident evidence, action params): dump what was given.

A stored JSON object read into a model comes back out as the same object: the fields the
row holds, plus keys the model does not know (written by another release), and never a
default the row did not have. So the API returns what the database stores, and a reader's
``"key" in evidence`` keeps its meaning across releases.
"""

from __future__ import annotations

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer


class OnlyGiven(BaseModel):
    """Serializes the fields set on the instance and its extra keys, no defaults added."""

    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        data = handler(self)
        given = self.model_fields_set | set(self.model_extra or {})
        return {k: v for k, v in data.items() if k in given}


__all__ = ["OnlyGiven"]
