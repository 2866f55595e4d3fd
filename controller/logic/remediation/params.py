"""Typed parameters of the remediation engine's action rows.

A restart's row carries what the goodput ledger needs to be rebuilt by a new leader
(:func:`~controller.services.remediation.history.replay`): the writer (the ``restart`` step
and the resume wait) and the reader build and parse the same model, so a field renamed on
one side is a type error, not a ledger that silently stops being rebuilt. Stored as JSON in
``actions.params["goodput"]``; the API and CLI show it as part of ``params``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class GoodputFacts(BaseModel):
    """What one restart cost its job, as the goodput ledger was told."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: The ledger's name for the incident (its id, or ``grow:<remediation>``).
    ledger_id: str
    #: The incident kind, or ``grow`` for a grow-back.
    kind: str
    fault_unix_s: float
    detected_unix_s: float
    #: The newest step reached before the restart, and the checkpoint step resumed from.
    last_step: int
    resume_step: int
    #: Median healthy step time when the restart began (``None``: not known yet).
    step_s: float | None
    #: Added when the job steps again (the resume wait).
    restart_unix_s: float | None = None
    resumed_unix_s: float | None = None

    def to_params(self) -> dict[str, Any]:
        """The JSON the action row stores: the fields given, no others."""
        return self.model_dump(mode="json", exclude_unset=True)

    def resumed(self, *, restart_unix_s: float | None, resumed_unix_s: float) -> GoodputFacts:
        return self.model_validate(
            self.to_params() | {"restart_unix_s": restart_unix_s, "resumed_unix_s": resumed_unix_s}
        )


__all__ = ["GoodputFacts"]
