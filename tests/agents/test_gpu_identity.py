"""A rank's GPU as the node agent knows it: the UUID wins over CUDA's pod-relative number.

On Kubernetes the device plugin hands a pod a subset of the node's GPUs, so the pod's CUDA
device 0 can be the node's GPU 5, while the agent keys NVML samples by the node's index. The
rank now sends its GPU's UUID (``LocalHello.gpu_uuid``) and the agent relays the index that
UUID has in its inventory. The agent side runs on the simulated NVML driver (pynvml's names,
``GPU-`` UUIDs); the rank side's spelling and ``CUDA_VISIBLE_DEVICES`` parsing are pure.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from agents.gpu.sim import SimNvml
from agents.local_endpoint import GpuPlacer, canonical_uuid
from collectives.gpu_identity import gpu_index, gpu_uuid, nvml_uuid, visible_entry
from tests.agents.agents_testkit import LocalClient
from trainguard.wire import GpuInfo, JobRecords, LocalHello, RankEvent, Report, StepSummary

BARE = "5a3c6f1e-0b2d-4e8f-9a1b-2c3d4e5f6a7b"


def _uuids(nvml: Any) -> list[str]:
    """A (simulated) driver's GPU UUIDs by NVML index, read through pynvml's calls."""
    count = nvml.nvmlDeviceGetCount()
    return [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]


def _sim_uuids(count: int = 8) -> list[str]:
    nvml = SimNvml(gpu_count=count, identity="gpu-node-5")
    nvml.nvmlInit()
    try:
        return _uuids(nvml)
    finally:
        nvml.nvmlShutdown()


def _hello(rank: int, index: int | None, gpu_uuid: str = "") -> LocalHello:
    return LocalHello(job="train", rank=rank, world_size=8, pid=100 + rank, gpu_index=index,
                      gpu_uuid=gpu_uuid, pod=f"train-{rank}", namespace="ml")  # fmt: skip


def _step(rank: int, index: int | None) -> StepSummary:
    return StepSummary(job="train", rank=rank, world_size=8, step=1, step_time_s=1.0,
                       compute_time_s=0.8, collective_wait_s=0.2, gpu_index=index)  # fmt: skip


# --------------------------------------------------------------------------- agent side


def test_a_pods_cuda_device_0_is_relayed_as_the_nodes_gpu_by_its_uuid(
    agent_factory: Any, short_tmp: Path
) -> None:
    """Rank 0 runs on CUDA device 0 of its pod, which is the node's GPU 5 (its UUID says so);
    rank 1 sends torch's bare UUID spelling of GPU 2. Before, the agent relayed their own
    numbers (0 and 1), so a straggler on GPU 5 was read against GPU 0's clocks and XIDs.
    Now the report and the GPU-to-pod map carry 5 and 2."""
    agent = agent_factory(gpus="sim:8", socket_path=str(short_tmp / "agent.sock"))
    uuids = _uuids(agent.backend.api)  # the agent's own (simulated) driver
    assert agent.endpoint is not None and len(uuids) == 8
    agent.endpoint.start()
    clients = [LocalClient(str(agent.endpoint.path)) for _ in range(2)]
    try:
        hellos = [_hello(0, 0, uuids[5]), _hello(1, 1, uuids[2].removeprefix("GPU-").upper())]
        for client, hello in zip(clients, hellos, strict=True):
            assert client.send_raw(hello.model_dump_json().encode()).ok
        event = RankEvent(job="train", rank=0, kind="heartbeat", time_unix_s=1.0, gpu_index=0)
        assert clients[0].records(JobRecords(steps=[_step(0, 0)], rank_events=[event])).ok
        assert clients[1].records(JobRecords(steps=[_step(1, 1)])).ok
        assert agent._gpu_pods() == {5: ("train-0", "ml"), 2: ("train-1", "ml")}
    finally:
        for client in clients:
            client.close()
        agent.endpoint.stop()
    report = Report.model_validate_json(agent.spool.path_for(agent.flush()).read_bytes())
    assert {s.rank: s.gpu_index for s in report.job.steps} == {0: 5, 1: 2}
    assert [e.gpu_index for e in report.job.rank_events] == [5]


def test_unknown_mig_and_missing_uuids_keep_the_ranks_number_logged_once_per_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    uuids = _sim_uuids()
    inventory = [GpuInfo(index=i, uuid=u) for i, u in enumerate(uuids)]
    placer = GpuPlacer(lambda: inventory)
    caplog.set_level(logging.INFO, logger="agents.local_endpoint")
    old_rank = _hello(0, 3)  # an older rank: no UUID field at all
    assert placer.place(old_rank) == (old_rank, False)
    other_node = _hello(1, 1, f"GPU-{BARE}")
    mig = _hello(2, 0, f"MIG-{BARE}")
    assert placer.place(other_node) == (other_node, False)
    assert placer.place(mig) == (mig, False)
    unknown = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(unknown) == 1 and "not on this node" in unknown[0]  # once per job
    for rank in range(3):
        placed, found = placer.place(_hello(rank, rank, uuids[7]))
        assert found and placed.gpu_index == 7
    moved = [r.getMessage() for r in caplog.records if "its UUID" in r.getMessage()]
    assert len(moved) == 1 and "this node's GPU 7" in moved[0]
    assert GpuPlacer(None).place(_hello(0, 4, uuids[1]))[0].gpu_index == 4  # no inventory


def test_uuid_spellings_match_one_canonical_form() -> None:
    assert canonical_uuid(f" GPU-{BARE.upper()} ") == f"gpu-{BARE}"
    assert canonical_uuid(BARE) == f"gpu-{BARE}"
    assert canonical_uuid(f"MIG-{BARE}") == f"mig-{BARE}"
    assert canonical_uuid("") == ""


# --------------------------------------------------------------------------- rank side


class _CuUuid:
    """The shape of torch's ``_CUuuid`` (``get_device_properties(d).uuid`` on a CUDA build):
    16 raw ``bytes`` as a list of ints, ``str`` the bare 8-4-4-4-12 form. This CPU build of
    torch has no CUDA types to make one from."""

    def __init__(self, value: uuid.UUID) -> None:
        self.bytes = list(value.bytes)
        self._text = str(value)

    def __str__(self) -> str:
        return self._text


def test_torch_uuid_spellings_become_nvmls() -> None:
    value = uuid.UUID(BARE)
    assert nvml_uuid(_CuUuid(value)) == f"GPU-{BARE}"
    assert nvml_uuid(value) == f"GPU-{BARE}"
    assert nvml_uuid(BARE.upper()) == f"GPU-{BARE}"
    assert nvml_uuid(f"GPU-{BARE}") == f"GPU-{BARE}"
    assert nvml_uuid(value, f"MIG-{BARE}") == f"MIG-{BARE}"  # CUDA cannot tell MIG; the env can
    assert nvml_uuid(value, "mig-gpu-x/1/0") == f"MIG-{BARE}"  # not a UUID: CUDA's answer
    # Drivers before R470 name a slice by its parent: that GPU's UUID is sent, whatever
    # CUDA answers (those drivers' NVML lists no MIG-<hex> to match).
    parent = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    assert nvml_uuid(value, f"MIG-GPU-{parent.upper()}/1/0") == f"GPU-{parent}"
    assert nvml_uuid(None, f"mig-gpu-{parent}/13/2") == f"GPU-{parent}"
    assert nvml_uuid(value, f"MIG-GPU-{parent}/1") == f"MIG-{BARE}"  # not that naming
    assert nvml_uuid("not-a-uuid") == ""
    assert nvml_uuid(None, f"gpu-{BARE.upper()}") == f"GPU-{BARE}"  # unreadable: the env's
    assert nvml_uuid(None, "GPU-5a3c") == ""  # a prefix CUDA accepts is no UUID to send


def test_cuda_visible_devices_entries_by_cuda_device() -> None:
    visible = f"GPU-{BARE}, MIG-{BARE} ,3"
    assert visible_entry(visible, 0) == f"GPU-{BARE}"
    assert visible_entry(visible, 1) == f"MIG-{BARE}"
    assert visible_entry(visible, 2) == "3"
    assert visible_entry(visible, 3) == ""
    assert visible_entry(None, 0) == visible_entry("", 0) == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_on_cpu_a_rank_sends_no_uuid_and_its_launchers_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRAINGUARD_GPU_INDEX", "6")
    assert gpu_uuid() == "" and gpu_index() == 6
    monkeypatch.delenv("TRAINGUARD_GPU_INDEX")
    assert gpu_index() is None
