"""The power policy wired into the controller (issue 6): loop, tree storage, API views.

Named ``powerctl`` so it never shadows the ``power`` library it drives. Parts:
:mod:`~controller.services.power.loop` (readings in, commands out), :mod:`.tracking` (the
Actions), :mod:`.persist` (the ``power_domains`` table), :mod:`.service` (tree source,
edits and views), :mod:`.schemas` (API shapes). Errors are the controller's own
(:mod:`controller.errors`); a bad tree is :class:`power.ConfigError`, turned into 422.
"""

from __future__ import annotations

from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.incidents import IncidentService
from controller.services.power.loop import PowerLoop
from controller.services.power.service import PowerService
from controller.settings import ControllerSettings
from controller.state import ClusterState
from controller.store import Store


def build_power(
    settings: ControllerSettings,
    state: ClusterState,
    store: Store,
    commands: CommandService,
    incidents: IncidentService,
    actions: ActionService,
) -> PowerService:
    loop = PowerLoop(
        state,
        commands,
        incidents,
        actions,
        tick_interval_s=settings.power_tick_interval_s,
        rank_active_within_s=settings.node_lost_after_s,
    )
    return PowerService(
        loop, store, state, domains_file=settings.power_domains_file, enabled=settings.power_enabled
    )


__all__ = ["PowerLoop", "PowerService", "build_power"]
