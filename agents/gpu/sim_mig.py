"""MIG instances for the simulated NVML, with pynvml's names, argument order and errors.

Kept apart from :mod:`agents.gpu.sim` so the driver surface stays readable; the methods are
mixed into :class:`~agents.gpu.sim.SimNvml`. A GPU in MIG mode (the model's ``mig_mode``)
holds ``mig_instances`` instances in its first slots, as a one-pod-per-slice node does, and
answers as the driver does: ``nvmlDeviceGetMaxMigDeviceCount`` is the model's ``mig_slots``
in MIG mode and 0 otherwise (NVML: "zero if MIG is not supported or enabled");
``nvmlDeviceGetMigDeviceHandleByIndex`` raises NOT_FOUND for an empty slot below that count
and INVALID_ARGUMENT at or past it; ``nvmlDeviceGetUUID`` of a MIG device handle is
``MIG-<8-4-4-4-12>``, the same for the same node identity, seed, GPU and slot. With
``mig_no_permission`` the handles are refused (NO_PERMISSION), as in a container without the
``mig/monitor`` capability. Every other call on a MIG device handle answers NOT_SUPPORTED:
the simulator models whole boards.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

import pynvml

from agents.gpu.sim_events import SimHandle, sim_error
from agents.gpu.sim_model import SimGpuModel


@dataclass(slots=True, frozen=True)
class SimMigHandle:
    """A MIG device handle (the real one is a ctypes pointer): its parent GPU and slot."""

    parent: int
    slot: int


def sim_mig_uuid(key: str, gpu: int, slot: int) -> str:
    """The UUID of ``gpu``'s MIG instance in ``slot`` on the simulated node keyed ``key``;
    a generator of its own, so adding MIG left every GPU's UUID as it was."""
    rng = random.Random(f"sim-mig:{key}:{gpu}:{slot}")
    return f"MIG-{uuid.UUID(int=rng.getrandbits(128), version=4)}"


class SimMigMixin:
    """The MIG half of the simulated driver; state lives in :class:`SimNvml`."""

    model: SimGpuModel
    mig_no_permission: bool
    _key: str
    _mig_mode: list[int]
    _handles: list[SimHandle]

    def _gpu(self, handle: Any, name: str) -> Any:
        raise NotImplementedError

    def _mig_slots(self, gpu: int) -> int:
        return self.model.mig_slots if self._mig_mode[gpu] == pynvml.NVML_DEVICE_MIG_ENABLE else 0

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetMaxMigDeviceCount")
        return self._mig_slots(gpu.index)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> SimMigHandle:
        gpu = self._gpu(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not 0 <= index < self._mig_slots(gpu.index):
            raise sim_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.mig_no_permission:
            raise sim_error(pynvml.NVML_ERROR_NO_PERMISSION)
        if index >= self.model.mig_instances:
            raise sim_error(pynvml.NVML_ERROR_NOT_FOUND)
        return SimMigHandle(gpu.index, index)

    def _mig_device_uuid(self, handle: SimMigHandle) -> str:
        """``nvmlDeviceGetUUID`` of a MIG device: its parent must still answer."""
        self._gpu(self._handles[handle.parent], "nvmlDeviceGetUUID")
        return sim_mig_uuid(self._key, handle.parent, handle.slot)


__all__ = ["SimMigHandle", "SimMigMixin", "sim_mig_uuid"]
