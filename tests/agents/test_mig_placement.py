"""A rank on a MIG slice is tied to the slice's parent GPU, not to CUDA's number.

On a MIG node (an A100 or H100 cut into slices, one pod per slice) every rank's CUDA device
is 0 and its UUID is the slice's (``MIG-...``), which no whole GPU has: the agent kept the
0, so every slice's rank was read against GPU 0's power, clocks and XIDs. The inventory now
lists each MIG-mode GPU's instances and the job endpoint maps a slice to its parent. All on
the simulated NVML (pynvml's names; MIG from ``SimGpuModel(mig_mode=1, mig_instances=N)``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pynvml
import pytest
from pydantic import TypeAdapter

from agents.gpu.sim import SimNvml
from agents.gpu.sim_model import SimGpuModel
from agents.local_endpoint import GpuPlacer, LocalEndpoint, Session
from agents.sampler import GpuSampler, MigGpuInfo
from tests.agents.agents_testkit import LocalClient
from trainguard.wire import GpuInfo, JobRecords, LocalHello, StepSummary

MIG = SimGpuModel(mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE, mig_instances=2)
BARE = "5a3c6f1e-0b2d-4e8f-9a1b-2c3d4e5f6a7b"
LOGGER = "agents.local_endpoint"


def _driver(model: SimGpuModel = MIG, **kw: Any) -> SimNvml:
    api = SimNvml(gpu_count=4, identity="mig-node", model=model, **kw)
    api.nvmlInit()
    return api


def _sampler(api: SimNvml) -> GpuSampler:
    sampler = GpuSampler(api)
    sampler.open()
    return sampler


def _slice_uuid(gpu: int, slot: int) -> str:
    """The UUID of ``gpu``'s MIG instance in ``slot``, read through pynvml's calls on a
    driver that may list it (the simulated UUIDs depend on the node, not on permissions)."""
    api = _driver()
    try:
        parent = api.nvmlDeviceGetHandleByIndex(gpu)
        return str(api.nvmlDeviceGetUUID(api.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)))
    finally:
        api.nvmlShutdown()


def _hello(rank: int, gpu_uuid: str, index: int | None = 0) -> LocalHello:
    return LocalHello(job="train", rank=rank, world_size=4, pid=100 + rank, gpu_index=index,
                      gpu_uuid=gpu_uuid)  # fmt: skip


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_rank_on_gpu_3s_second_mig_slice_is_relayed_as_gpu_3(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the slice's UUID was "unknown" and the rank kept CUDA's 0 (in its hello and in
    every step it relayed); now both say GPU 3, logged once per job at INFO."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    sampler = _sampler(_driver())
    relayed: list[JobRecords] = []

    def on_records(session: Session, records: JobRecords, size: int) -> None:
        relayed.append(records)

    endpoint = LocalEndpoint(
        short_tmp / "agent.sock", on_records=on_records, gpu_inventory=lambda: sampler.inventory
    )
    endpoint.start()
    client = LocalClient(str(short_tmp / "agent.sock"))
    try:
        hello = _hello(0, _slice_uuid(3, 1))
        assert client.send_raw(hello.model_dump_json().encode()).ok
        step = StepSummary(job="train", rank=0, world_size=4, step=1, step_time_s=1.0,
                           compute_time_s=0.8, collective_wait_s=0.2, gpu_index=0)  # fmt: skip
        assert client.records(JobRecords(steps=[step])).ok
    finally:
        client.close()
        endpoint.stop()
    session = endpoint.sessions()[0]
    assert session.hello is not None and session.hello.gpu_index == 3
    assert [s.gpu_index for s in relayed[0].steps] == [3]
    said = [r.getMessage() for r in caplog.records if "MIG instance" in r.getMessage()]
    assert said == [
        f"job train rank 0: MIG instance {hello.gpu_uuid} is on GPU 3 (says GPU 0) (once per job)"
    ]
    assert not _warnings(caplog)


def test_a_slice_is_found_in_every_spelling_and_logged_once_per_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pod whose CUDA_VISIBLE_DEVICES did not name the slice sends ``GPU-<hex>`` (CUDA
    cannot tell a slice); a rank already claiming the parent's number is left untouched."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    sampler = _sampler(_driver())
    placer = GpuPlacer(lambda: sampler.inventory)
    hex_ = _slice_uuid(2, 0).removeprefix("MIG-")
    assert placer.place(_hello(0, f"GPU-{hex_.upper()}"))[0].gpu_index == 2
    placed, moved = placer.place(_hello(1, f"mig-{hex_}", index=2))
    assert placed.gpu_index == 2 and not moved
    assert placer.place(_hello(2, _slice_uuid(0, 1), index=3)) == (
        _hello(2, _slice_uuid(0, 1), index=0),
        True,
    )
    assert len([r for r in caplog.records if "MIG instance" in r.getMessage()]) == 1


def test_mig_disabled_keeps_the_ranks_number_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    sampler = _sampler(_driver(SimGpuModel(mig_instances=2)))  # mig_mode 0: no slices
    assert not any(isinstance(g, MigGpuInfo) for g in sampler.inventory)
    hello = _hello(0, _slice_uuid(3, 1))
    assert GpuPlacer(lambda: sampler.inventory).place(hello) == (hello, False)
    assert _warnings(caplog) == [
        f"job train rank 0: GPU UUID {hello.gpu_uuid} is a MIG instance, but no GPU of this "
        "node is in MIG mode; keeping GPU index 0 (a launcher can set TRAINGUARD_GPU_INDEX to "
        "the node's NVML index) (once per job)"
    ]


@pytest.mark.parametrize(
    ("refusal", "error"),
    [
        ({"mig_no_permission": True}, "Insufficient Permissions"),
        ({"unsupported": ["nvmlDeviceGetMigDeviceHandleByIndex"]}, "Not Supported"),
        ({"unsupported": ["nvmlDeviceGetMaxMigDeviceCount"]}, "Not Supported"),
    ],
)
def test_refused_mig_enumeration_keeps_the_number_and_the_inventory(
    caplog: pytest.LogCaptureFixture, refusal: dict[str, Any], error: str
) -> None:
    """A non-root container often may not list MIG devices: the inventory still has every
    whole GPU (placed as before), the slice's rank keeps its number, and both logs say why."""
    caplog.set_level(logging.INFO)
    api = _driver(**refusal)
    sampler = _sampler(api)
    whole = [str(api.nvmlDeviceGetUUID(api.nvmlDeviceGetHandleByIndex(i))) for i in range(4)]
    assert [(g.index, g.uuid) for g in sampler.inventory] == list(enumerate(whole))
    assert [g.mig_error for g in sampler.inventory if isinstance(g, MigGpuInfo)] == [
        f"MIG instances: {error}"
    ] * 4
    start = [m for m in _warnings(caplog) if "cannot list its MIG instances" in m]
    assert len(start) == 4 and error in start[3]
    caplog.clear()
    placer = GpuPlacer(lambda: sampler.inventory)
    hello = _hello(0, _slice_uuid(3, 1))
    assert placer.place(hello) == (hello, False)
    [said] = _warnings(caplog)
    assert f"GPU UUID {hello.gpu_uuid} is a MIG instance of a GPU whose instances could " in said
    assert f"GPU 3: MIG instances: {error}" in said and "keeping GPU index 0" in said
    other_job = _hello(1, whole[2]).model_copy(update={"job": "other"})
    assert placer.place(other_job)[0].gpu_index == 2


def test_an_unknown_mig_uuid_keeps_the_ranks_number(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    sampler = _sampler(_driver())
    hello = _hello(0, f"MIG-{BARE}", index=1)
    assert GpuPlacer(lambda: sampler.inventory).place(hello) == (hello, False)
    [said] = _warnings(caplog)
    assert "is a MIG instance, but not one of those of GPU(s) 0, 1, 2, 3" in said
    assert "keeping GPU index 1" in said


def test_the_reported_inventory_keeps_its_shape() -> None:
    """The MIG lists are the agent's own: a report's GpuInfo has no new fields."""
    inventory = _sampler(_driver()).inventory
    assert isinstance(inventory[3], MigGpuInfo) and len(inventory[3].mig_uuids) == 2
    sent = TypeAdapter(list[GpuInfo]).dump_python(inventory)
    assert all(set(g) == set(GpuInfo.model_fields) for g in sent)
    assert "mig" not in TypeAdapter(list[GpuInfo]).dump_json(inventory).decode().lower()


def test_the_mig_layout_is_read_with_the_inventory_not_at_each_sample_or_hello() -> None:
    """A MIG layout changes only by an admin's action: asked once per GPU at discovery."""
    api = _driver()
    asked: list[object] = []
    real = api.nvmlDeviceGetMaxMigDeviceCount

    def counting(device: object) -> int:
        asked.append(device)
        return int(real(device))

    api.nvmlDeviceGetMaxMigDeviceCount = counting  # type: ignore[method-assign]
    sampler = _sampler(api)
    placer = GpuPlacer(lambda: sampler.inventory)
    for rank in range(3):
        sampler.sample()
        assert placer.place(_hello(rank, _slice_uuid(1, 0)))[0].gpu_index == 1
    assert len(asked) == 4
    sampler.close()


# --------------------------------------------------------------------------- the simulator


def test_the_simulated_mig_devices_answer_as_nvml_does() -> None:
    api = _driver()
    parent, whole_gpu = api.nvmlDeviceGetHandleByIndex(3), _driver(SimGpuModel())
    assert api.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert api.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    first = api.nvmlDeviceGetUUID(api.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0))
    second = api.nvmlDeviceGetUUID(api.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1))
    pattern = r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert re.fullmatch(pattern, first) and re.fullmatch(pattern, second) and first != second
    with pytest.raises(pynvml.NVMLError_NotFound):
        api.nvmlDeviceGetMigDeviceHandleByIndex(parent, 2)  # an empty slot
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        api.nvmlDeviceGetMigDeviceHandleByIndex(parent, 7)  # past the last slot
    mig = api.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        api.nvmlDeviceGetPowerUsage(mig)  # the simulator models whole boards
    # MIG mode off: no slots at all, and the GPUs' own UUIDs do not depend on MIG.
    off = whole_gpu.nvmlDeviceGetHandleByIndex(3)
    assert whole_gpu.nvmlDeviceGetMaxMigDeviceCount(off) == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        whole_gpu.nvmlDeviceGetMigDeviceHandleByIndex(off, 0)
    assert whole_gpu.nvmlDeviceGetUUID(off) == api.nvmlDeviceGetUUID(parent)
    with pytest.raises(ValueError, match="mig_instances=8"):
        SimGpuModel(mig_instances=8)
