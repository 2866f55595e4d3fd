"""The wire contract between node agents, job-side code and the controller (``/api/v1``).

Both sides import this module and nothing else of ours does the translating, so a field
means the same thing everywhere. Rules that keep old agents working after a controller
upgrade (and the other way round):

* every model ignores unknown fields;
* a new field always gets a default; a field never changes its meaning or unit;
* units are in the names (``_w``, ``_j``, ``_mhz``, ``_bytes``, ``_s``, ``_pct``, ``_c``);
* times are POSIX seconds (``*_unix_s``) stamped by the sender's clock. Detectors compare
  *durations* reported by each rank, never timestamps from different nodes, so clock skew
  cannot fake a straggler.

Shape of one exchange::

    agent --POST /api/v1/reports (Report)--> controller
    agent <--------- ReportReply (ack + Commands) ---------

A report is identified by ``(node.name, agent_instance, seq)``. ``seq`` grows by one per
report; ``agent_instance`` changes only when the agent's spool is created afresh, so a
wiped spool restarting at seq 0 is not mistaken for a replay. The controller acknowledges
a report it has already stored (``duplicate=True``) without counting it again.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from trainguard import limits
from trainguard.limits import NO_NUL

API_VERSION = "v1"
API_PREFIX = f"/api/{API_VERSION}"
SCHEMA_VERSION = 1

#: Largest report body the controller accepts (bytes). A node with 8 GPUs reporting every
#: 5 s with a few hundred step summaries is ~200 KiB; 4 MiB leaves room for batches sent
#: after an outage without letting one client exhaust memory.
MAX_REPORT_BYTES = 4 * 1024 * 1024

#: Most ranks in one peer group or collective group carried on the wire.
MAX_GROUP_RANKS = 100_000
#: Most process groups one Flight Recorder dump lists (``pg_ranks``).
MAX_DUMP_GROUPS = 4_096

#: Kubernetes-compatible object name (RFC 1123 subdomain).
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"

Name = Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)]
#: Numbers carry the database's real limits (``trainguard.limits``): counts fit a bigint,
#: floats are finite, indices and ranks fit an integer.
NonNegInt = limits.Count
NonNegFloat = limits.NonNegFinite
Index = limits.Index
Rank = limits.Count32
#: The highest training step a summary may carry. Steps are counts (10^12 steps at 1 ms each
#: is 30 years); a larger one is a broken or hostile report, and it would lift the job's last
#: step, and the goodput ledger's high-water mark, for good.
MAX_STEP = 10**12
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]


def _rank_in_world(rank: int, world_size: int | None) -> None:
    if world_size is not None and rank >= world_size:
        raise ValueError(f"rank {rank} must be less than world_size {world_size}")


def _distinct(ranks: list[int]) -> list[int]:
    """A group's members are a set: a rank listed twice is a broken or hostile list (it
    would count twice towards the group's size, and in its ring of probe pairs)."""
    if len(set(ranks)) != len(ranks):
        (twice, _), *_ = Counter(ranks).most_common(1)
        raise ValueError(f"rank {twice} is listed twice")
    return ranks


#: The global ranks of a group: each a rank, none twice, at most ``MAX_GROUP_RANKS``.
#: Whether they are below the job's world size is not checked here, not even in a step
#: summary that carries its world size: job-side code builds these models on its hot path
#: (a test's mock mesh gives any ranks), and a refusal there must not stop training. The
#: controller ignores what names a rank outside the world (``controller.logic.detection``).
GroupRanks = Annotated[list[Rank], Field(max_length=MAX_GROUP_RANKS), AfterValidator(_distinct)]


class WireModel(BaseModel):
    """Base for every wire model: unknown fields are ignored, not rejected."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# --------------------------------------------------------------------------- identity


class GpuInfo(WireModel):
    """One GPU's static inventory, sent with every report (cheap, and self-healing)."""

    index: Index
    uuid: str = Field(min_length=1, max_length=128, pattern=NO_NUL)
    name: str = Field(
        default="", max_length=128, pattern=NO_NUL, description="Model name, e.g. NVIDIA H100"
    )
    pci_bus_id: str = Field(default="", max_length=64, pattern=NO_NUL)
    memory_total_bytes: NonNegInt = 0
    power_limit_min_w: limits.GpuWatts | None = None
    power_limit_max_w: limits.GpuWatts | None = None
    power_limit_default_w: limits.GpuWatts | None = None
    sm_clock_max_mhz: Rank | None = None
    mem_clock_max_mhz: Rank | None = None


class NicInfo(WireModel):
    """One RDMA port's static description and its PCIe distance to each GPU.

    ``gpu_affinity`` uses nvidia-smi ``topo -m`` levels, nearest first: ``PIX`` (one PCIe
    switch between them), ``PXB`` (several switches, no host bridge), ``PHB`` (same host
    bridge / root complex), ``NODE`` (same NUMA node, different host bridges), ``SYS``
    (across the CPU interconnect).
    """

    device: str = Field(max_length=64, pattern=NO_NUL, description="e.g. mlx5_0")
    port: Index
    link_layer: str = Field(
        default="", max_length=32, pattern=NO_NUL, description="InfiniBand | Ethernet"
    )
    pci_bus_id: str = Field(default="", max_length=64, pattern=NO_NUL)
    netdev: str = Field(
        default="", max_length=64, pattern=NO_NUL, description="Ethernet interface, if any"
    )
    numa_node: limits.SignedIndex | None = None
    gpu_affinity: dict[Index, limits.StateText] = Field(
        default_factory=dict, description="GPU index -> level"
    )


class NodeIdentity(WireModel):
    name: Name
    hostname: str = Field(default="", max_length=253, pattern=NO_NUL)
    labels: dict[limits.KeyText, limits.NameText] = Field(default_factory=dict, max_length=512)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=64)
    agent_version: str = Field(default="", max_length=64, pattern=NO_NUL)
    backend: Literal["nvml", "sim"] = Field(
        default="nvml", description="nvml: real GPUs read through NVML; sim: simulated GPUs"
    )
    driver_version: str = Field(default="", max_length=64, pattern=NO_NUL)
    gpu_error: str = Field(
        default="",
        max_length=512,
        pattern=NO_NUL,
        description=(
            "Why NVML could not be used on a node that has NVIDIA device files (the nvmlInit "
            "error); empty when NVML works or the node has no NVIDIA devices. A node reporting "
            "this is unhealthy: its GPUs exist but cannot be watched"
        ),
    )
    nics: list[NicInfo] = Field(default_factory=list, max_length=256)


# --------------------------------------------------------------------------- GPU samples


class ThrottleReason(StrEnum):
    """Names of NVML's ``nvmlClocksEventReasons`` bits, decoded by the agent."""

    GPU_IDLE = "gpu_idle"
    APPLICATIONS_CLOCKS_SETTING = "applications_clocks_setting"
    SW_POWER_CAP = "sw_power_cap"
    HW_SLOWDOWN = "hw_slowdown"
    SYNC_BOOST = "sync_boost"
    SW_THERMAL_SLOWDOWN = "sw_thermal_slowdown"
    HW_THERMAL_SLOWDOWN = "hw_thermal_slowdown"
    HW_POWER_BRAKE_SLOWDOWN = "hw_power_brake_slowdown"
    DISPLAY_CLOCK_SETTING = "display_clock_setting"


#: Bit values from NVML (``nvmlClocksEventReason*``), so agents decode identically.
THROTTLE_REASON_BITS: dict[ThrottleReason, int] = {
    ThrottleReason.GPU_IDLE: 0x1,
    ThrottleReason.APPLICATIONS_CLOCKS_SETTING: 0x2,
    ThrottleReason.SW_POWER_CAP: 0x4,
    ThrottleReason.HW_SLOWDOWN: 0x8,
    ThrottleReason.SYNC_BOOST: 0x10,
    ThrottleReason.SW_THERMAL_SLOWDOWN: 0x20,
    ThrottleReason.HW_THERMAL_SLOWDOWN: 0x40,
    ThrottleReason.HW_POWER_BRAKE_SLOWDOWN: 0x80,
    ThrottleReason.DISPLAY_CLOCK_SETTING: 0x100,
}


def decode_throttle_reasons(mask: int) -> list[ThrottleReason]:
    """The names of the bits set in an NVML throttle-reason mask, in bit order."""
    return [reason for reason, bit in THROTTLE_REASON_BITS.items() if mask & bit]


class XidEvent(WireModel):
    code: Rank
    time_unix_s: NonNegFloat
    gpu_index: Index | None = None
    detail: str = Field(default="", max_length=512, pattern=NO_NUL)


class NvLinkSample(WireModel):
    """One NVLink of one GPU: state and its error counters since driver load."""

    link: Index
    active: bool
    crc_errors_total: NonNegInt | None = Field(default=None, description="DL CRC flit + data")
    replay_errors_total: NonNegInt | None = None
    recovery_errors_total: NonNegInt | None = None


class EccLocationCounts(WireModel):
    """ECC errors at one memory location (``nvmlDeviceGetMemoryErrorCounter``)."""

    location: str = Field(
        max_length=32, pattern=NO_NUL, description="l1_cache, l2_cache, dram, sram, ..."
    )
    counter: Literal["volatile", "aggregate"]
    corrected: NonNegInt | None = None
    uncorrected: NonNegInt | None = None


class GpuSample(WireModel):
    """One GPU at one instant. ``None`` means the driver did not answer for that field."""

    index: Index
    uuid: str = Field(default="", max_length=128, pattern=NO_NUL)
    lost: bool = Field(default=False, description="NVML reported the GPU lost / off the bus")
    power_w: limits.GpuWatts | None = None
    energy_j: NonNegFloat | None = Field(default=None, description="Total since driver load")
    power_limit_w: limits.GpuWatts | None = None
    temperature_c: limits.Finite | None = None
    sm_clock_mhz: Rank | None = None
    mem_clock_mhz: Rank | None = None
    locked_sm_clock_mhz: Rank | None = Field(
        default=None, description="Upper SM clock lock in force, if the agent set one"
    )
    utilization_gpu_pct: limits.Percent | None = None
    utilization_mem_pct: limits.Percent | None = None
    memory_used_bytes: NonNegInt | None = None
    memory_total_bytes: NonNegInt | None = None
    throttle_reasons_mask: NonNegInt = 0
    throttle_reasons: list[ThrottleReason] = Field(default_factory=list)
    ecc_corrected_total: NonNegInt | None = None
    ecc_uncorrected_total: NonNegInt | None = None
    xid_events: list[XidEvent] = Field(default_factory=list, max_length=1024)
    pcie_link_gen: Rank | None = None
    pcie_link_width: Rank | None = None
    pcie_link_gen_max: Rank | None = None
    pcie_link_width_max: Rank | None = None
    nvlink_crc_errors_total: NonNegInt | None = None
    nvlink_replay_errors_total: NonNegInt | None = None
    nvlink_recovery_errors_total: NonNegInt | None = None
    unknown: bool = Field(
        default=False,
        description=(
            "Nothing could be read this tick: an NVML call hung past the agent's timeout or "
            "failed unexpectedly; ``error`` says which. Unknown is not healthy"
        ),
    )
    error: str = Field(
        default="",
        max_length=512,
        pattern=NO_NUL,
        description="First NVML error of this sample, one line",
    )
    unreachable: bool = Field(
        default=False,
        description=(
            "No NVML read of this GPU has answered for several samples in a row (every one "
            "failed with an error other than NOT_SUPPORTED, e.g. NVML_ERROR_UNKNOWN on a "
            "wedged GPU); ``error`` says which. Cleared by the first sample that reads again"
        ),
    )
    ecc_corrected_aggregate_total: NonNegInt | None = Field(
        default=None, description="Corrected ECC errors over the board's life"
    )
    ecc_uncorrected_aggregate_total: NonNegInt | None = None
    ecc_locations: list[EccLocationCounts] = Field(
        default_factory=list,
        max_length=32,
        description="Locations with a non-zero count (zero ones are left out)",
    )
    retired_pages_sbe: NonNegInt | None = Field(
        default=None, description="Pages retired for multiple single-bit errors (pre-Ampere)"
    )
    retired_pages_dbe: NonNegInt | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: NonNegInt | None = Field(
        default=None, description="Rows remapped after correctable errors (Ampere and later)"
    )
    remapped_rows_uncorrectable: NonNegInt | None = None
    row_remap_pending: bool | None = Field(
        default=None, description="A remap waits for a GPU reset to take effect"
    )
    row_remap_failed: bool | None = Field(
        default=None, description="A row could not be remapped: the GPU needs service"
    )
    pcie_replay_total: NonNegInt | None = Field(
        default=None, description="PCIe replay counter (nvmlDeviceGetPcieReplayCounter)"
    )
    nvlinks: list[NvLinkSample] = Field(
        default_factory=list,
        max_length=32,
        description=(
            "Links that are down or have counted errors; healthy links are left out to keep "
            "reports small (how many are up is nvlink_active_count)"
        ),
    )
    nvlink_active_count: Rank | None = Field(
        default=None, description="NVLinks up now, of those up when the agent started"
    )
    fabric_state: str | None = Field(
        default=None,
        max_length=32,
        pattern=NO_NUL,
        description="GPU fabric state: not_supported, not_started, in_progress, completed",
    )
    fabric_status: limits.Int32 | None = Field(
        default=None, description="nvmlReturn_t of the fabric registration (0 = success)"
    )
    mig_mode: bool | None = None
    mig_mode_pending: bool | None = None


#: Kinds of :class:`HardwareEvent` the agent sends today (an older controller ignores kinds
#: it does not know; the set may grow).
HARDWARE_EVENT_KINDS = (
    "nvlink_down",
    "nvlink_up",
    "pcie_link_degraded",
    "pcie_link_restored",
    "nic_port_down",
    "nic_port_up",
    "nic_gone",
    "nic_back",
    "nic_errors_rising",
    "bond_member_down",
    "bond_member_up",
    "gpu_unknown",
    "gpu_unreachable",
)


class HardwareEvent(WireModel):
    """A change the agent saw between two ticks: a link flap, a NIC gone, errors rising."""

    kind: str = Field(max_length=32, pattern=NO_NUL)
    time_unix_s: NonNegFloat
    gpu_index: Index | None = None
    device: str = Field(
        default="", max_length=64, pattern=NO_NUL, description="NIC device or bond name"
    )
    port: Index | None = Field(default=None, description="RDMA port or NVLink number")
    counter: str = Field(
        default="", max_length=64, pattern=NO_NUL, description="Counter that rose, if any"
    )
    delta: NonNegInt | None = Field(default=None, description="How much it rose this interval")
    detail: str = Field(default="", max_length=512, pattern=NO_NUL)


class NicPortSample(WireModel):
    """One RDMA port read from ``/sys/class/infiniband/<device>/ports/<port>/``."""

    device: str = Field(max_length=64, pattern=NO_NUL)
    port: Index
    state: str = Field(
        default="", max_length=32, pattern=NO_NUL, description="e.g. ACTIVE, DOWN (sysfs text)"
    )
    phys_state: str = Field(
        default="", max_length=32, pattern=NO_NUL, description="e.g. LinkUp, Disabled"
    )
    rate_gbps: NonNegFloat | None = None
    link_layer: str = Field(default="", max_length=32, pattern=NO_NUL)
    counters: dict[limits.TokenText, NonNegInt] = Field(
        default_factory=dict,
        max_length=1024,
        description="counters/ and hw_counters/ files, name -> value",
    )


class BondMember(WireModel):
    name: str = Field(max_length=64, pattern=NO_NUL)
    mii_status: str = Field(default="", max_length=16, pattern=NO_NUL, description="up | down")
    operstate: str = Field(default="", max_length=16, pattern=NO_NUL)
    speed_mbps: limits.Int32 | None = None
    link_failure_count: NonNegInt | None = None


class BondSample(WireModel):
    """An Ethernet bond from ``/sys/class/net/<bond>/bonding/`` and its members."""

    name: str = Field(max_length=64, pattern=NO_NUL)
    mode: str = Field(default="", max_length=64, pattern=NO_NUL)
    active_slave: str = Field(default="", max_length=64, pattern=NO_NUL)
    members: list[BondMember] = Field(default_factory=list, max_length=32)


class NodeSample(WireModel):
    """Every GPU of a node sampled at one tick."""

    time_unix_s: NonNegFloat
    gpus: list[GpuSample] = Field(default_factory=list, max_length=64)
    node_power_w: limits.NodeWatts | None = None
    node_power_source: Literal["rapl", "gpu_sum", "none"] = "none"
    nics: list[NicPortSample] = Field(default_factory=list, max_length=256)
    bonds: list[BondSample] = Field(default_factory=list, max_length=64)
    events: list[HardwareEvent] = Field(default_factory=list, max_length=4_096)


# --------------------------------------------------------------------------- job records


class StepSummary(WireModel):
    """One rank's view of one training step (one record per rank per step).

    Durations are measured on the rank's own monotonic clock; only they are compared
    across ranks.
    """

    job: Name
    rank: Rank
    world_size: Annotated[int, Field(ge=1, le=limits.INT32_MAX)]
    step: Step
    step_time_s: NonNegFloat
    compute_time_s: NonNegFloat
    collective_wait_s: NonNegFloat
    collective_bytes: NonNegInt = 0
    collective_calls: NonNegInt = 0
    local_rank: Rank | None = None
    gpu_index: Index | None = None
    end_unix_s: NonNegFloat | None = None
    nonfinite_inputs: NonNegInt = Field(
        default=0,
        description=(
            "Reduction calls (all_reduce, reduce, reduce_scatter) in this step whose input from "
            "this rank held NaN or Inf before the call, i.e. before the reduction spread it"
        ),
    )
    nonfinite_first_op: str = Field(
        default="",
        max_length=64,
        pattern=NO_NUL,
        description="Op of the first such call in the step",
    )
    nonfinite_first_group: str = Field(
        default="",
        max_length=128,
        pattern=NO_NUL,
        description="Process-group id of the first such call",
    )
    nonfinite_first_seq: NonNegInt | None = Field(
        default=None,
        description="Per-group sequence number of the first such call (comparable across ranks)",
    )
    collective_enqueue_s: NonNegFloat | None = Field(
        default=None,
        description=(
            "Host time spent launching the step's device-timed collectives (CUDA events); "
            "their device durations make up collective_wait_s. None: no device-timed call"
        ),
    )
    role: str | None = Field(
        default=None,
        max_length=128,
        pattern=NO_NUL,
        description=(
            "What work this rank does, declared by the job (instrument(role=...)) or derived "
            "from its pipeline stage ('pp_stage=2'); ranks are compared only with the same role"
        ),
    )
    pp_stage: Rank | None = Field(
        default=None, description="Position in the pipeline (pipelining stage or mesh 'pp' dim)"
    )
    dp_rank: Rank | None = Field(
        default=None, description="Data-parallel index (mesh 'dp*' dims, row-major)"
    )
    tp_rank: Rank | None = Field(default=None, description="Tensor-parallel index")
    group_ranks: GroupRanks = Field(
        default_factory=list,
        description=(
            "Global ranks of this rank's peer group, those doing the same work (same pipeline "
            "stage of the mesh), itself included; empty when unknown. Current job-side code "
            "sends peer_group instead and the controller fills this in from the PeerGroup it "
            "declared; summaries that carry the list (older agents) are still accepted"
        ),
    )
    peer_group: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=NO_NUL,
        description=(
            "Id of this rank's peer group (peer_group_id of its ranks), declared once per "
            "registration in JobRecords.peer_groups instead of listed in every summary"
        ),
    )

    @model_validator(mode="after")
    def _rank_below_world_size(self) -> StepSummary:
        _rank_in_world(self.rank, self.world_size)
        return self


def peer_group_id(ranks: Iterable[int]) -> str:
    """The content address of a peer group: the same ranks give the same id on every rank,
    so the controller keeps one copy per job however many members declare it."""
    members = sorted(set(int(r) for r in ranks))
    digest = hashlib.sha256(",".join(map(str, members)).encode()).hexdigest()[:24]
    return f"pg{len(members)}-{digest}"


class PeerGroup(WireModel):
    """A peer group's membership, declared once per (re)registration of a rank with its
    agent and again when the controller asks (``ReportReply.peer_groups_unknown``, e.g. after
    a controller restart); step summaries refer to it by ``id``."""

    job: Name
    id: str = Field(
        min_length=1,
        max_length=64,
        pattern=NO_NUL,
        description="peer_group_id(ranks) as job-side code makes it; opaque to the controller",
    )
    ranks: GroupRanks = Field(min_length=1)


class PeerGroupRef(WireModel):
    """A peer group the controller was told of by id only and does not know."""

    job: Name
    id: str = Field(min_length=1, max_length=64, pattern=NO_NUL)


class InflightCollective(WireModel):
    """A collective a rank entered and has not finished, reported while it is stuck."""

    job: Name
    rank: Rank
    group: str = Field(
        max_length=128, pattern=NO_NUL, description="Process-group id, stable across ranks"
    )
    op: str = Field(max_length=64, pattern=NO_NUL)
    seq: NonNegInt = Field(description="Per-group sequence number of the stuck call")
    elapsed_s: NonNegFloat = Field(description="Time spent inside the call so far")
    size_bytes: NonNegInt = 0
    last_completed_seq: dict[limits.LabelText, limits.Int64] = Field(
        default_factory=dict,
        max_length=4096,
        description="Group id -> last finished sequence number",
    )
    step: NonNegInt | None = None
    group_ranks: GroupRanks = Field(
        default_factory=list,
        description="Global ranks of the group, so the controller knows who never entered",
    )


class RankEvent(WireModel):
    """A rank process started, exited or was killed."""

    job: Name
    rank: Rank
    kind: Literal["started", "exited", "heartbeat"]
    pid: Rank | None = None
    exit_code: limits.Int32 | None = None
    signal: str | None = Field(default=None, max_length=32, pattern=NO_NUL)
    time_unix_s: NonNegFloat
    local_rank: Rank | None = None
    gpu_index: Index | None = None
    world_size: Rank | None = None
    pod: str | None = Field(
        default=None,
        max_length=253,
        pattern=NO_NUL,
        description="Kubernetes pod of the rank (downward API), so the controller learns the "
        "job's placement from its ranks",
    )
    namespace: str | None = Field(
        default=None, max_length=63, pattern=NO_NUL, description="Namespace of that pod"
    )
    error: str = Field(
        default="", max_length=1024, pattern=NO_NUL, description="What ended the rank, one line"
    )
    collective_failed: bool = Field(
        default=False,
        description=(
            "The exception that ended the rank escaped a collective call: a peer died or the "
            "link broke, so this exit is most likely collateral damage of another fault"
        ),
    )
    disconnected: bool = Field(
        default=False,
        description=(
            "Reported by the node agent, not the rank: the rank's connection closed without an "
            "exit record and its process is gone (killed from outside: SIGKILL, the OOM "
            "killer); exit code and signal are unknown"
        ),
    )

    @model_validator(mode="after")
    def _rank_below_world_size(self) -> RankEvent:
        _rank_in_world(self.rank, self.world_size or None)  # 0: not known
        return self


class CheckpointEvent(WireModel):
    job: Name
    rank: Rank
    step: NonNegInt
    kind: Literal[
        "started",
        "snapshot_done",
        "durable",
        "failed",
        "committed",
        # The object-store tier's upload of the step (``tier="object_store"``): queued,
        # sending, in the bucket (``duration_s``: from the save to its remote commit), failed.
        "upload_pending",
        "uploading",
        "uploaded",
        "upload_failed",
        # Retention removed the step (``tier``: which copy): rank 0 of a shared root after a
        # commit, the uploader of rank 0 for the bucket. A committed step it names is gone
        # there: a rollback can no longer resume from it. Older ranks never send it.
        "deleted",
    ]
    tier: Literal["local", "object_store"] = Field(
        default="local", description="Which copy of the step the event is about"
    )
    blocking_s: NonNegFloat | None = None
    duration_s: NonNegFloat | None = None
    size_bytes: NonNegInt | None = None
    path: str = Field(default="", max_length=1024, pattern=NO_NUL)
    error: str = Field(default="", max_length=1024, pattern=NO_NUL)
    time_unix_s: NonNegFloat


class ProbeResult(WireModel):
    """A timed point-to-point transfer between two ranks during a link probe."""

    job: Name
    probe_id: str = Field(max_length=64, pattern=NO_NUL)
    src_rank: Rank
    dst_rank: Rank
    size_bytes: NonNegInt
    duration_s: NonNegFloat
    ok: bool = True
    error: str = Field(default="", max_length=512, pattern=NO_NUL)
    missed: bool = Field(
        default=False,
        description=(
            "The source rank never ran this probe (its command came after at_step): "
            "no evidence about the link, only that the round cannot use this pair"
        ),
    )


class FlightRecorderDump(WireModel):
    """One rank's PyTorch Flight Recorder ring buffer, dumped on a ``JobDumpTrace`` command
    (``collectives.flight``): the last collectives of every process group of the rank."""

    job: Name
    rank: Rank
    command_id: str = Field(default="", max_length=64, pattern=NO_NUL)
    time_unix_s: NonNegFloat = 0.0
    enabled: bool = Field(
        default=False, description="TORCH_FR_BUFFER_SIZE was set: the buffer exists"
    )
    entries: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=4_096,
        description="Flight Recorder's entries, newest last (its dump format, trimmed)",
    )
    pg_ranks: dict[limits.LabelText, GroupRanks] = Field(
        default_factory=dict,
        max_length=MAX_DUMP_GROUPS,
        description="torch process-group name -> global ranks",
    )
    path: str = Field(
        default="", max_length=1024, pattern=NO_NUL, description="Full dump on the node, if kept"
    )
    error: str = Field(default="", max_length=1024, pattern=NO_NUL)


class JobRecords(WireModel):
    """What job-side code on this node delivered to its agent since the last report."""

    steps: list[StepSummary] = Field(default_factory=list, max_length=20_000)
    inflight: list[InflightCollective] = Field(default_factory=list, max_length=4_096)
    rank_events: list[RankEvent] = Field(default_factory=list, max_length=4_096)
    checkpoints: list[CheckpointEvent] = Field(default_factory=list, max_length=4_096)
    probes: list[ProbeResult] = Field(default_factory=list, max_length=20_000)
    traces: list[FlightRecorderDump] = Field(default_factory=list, max_length=1_024)
    peer_groups: list[PeerGroup] = Field(
        default_factory=list,
        max_length=4_096,
        description="Peer-group memberships the summaries (of this or later reports) refer to",
    )

    def is_empty(self) -> bool:
        return not (
            self.steps
            or self.peer_groups
            or self.inflight
            or self.rank_events
            or self.checkpoints
            or self.probes
            or self.traces
        )


# --------------------------------------------------------------------------- commands


class CommandBase(WireModel):
    id: str = Field(
        min_length=1, max_length=64, pattern=NO_NUL, description="Unique; acks refer to it"
    )
    issued_unix_s: NonNegFloat = 0.0
    reason: str = Field(default="", max_length=512, pattern=NO_NUL)


class SetPowerLimit(CommandBase):
    kind: Literal["set_power_limit"] = "set_power_limit"
    gpu_index: Index
    limit_w: limits.PosFinite = Field(le=limits.GPU_WATTS_MAX)


class ResetPowerLimit(CommandBase):
    kind: Literal["reset_power_limit"] = "reset_power_limit"
    gpu_index: Index


class LockClocks(CommandBase):
    kind: Literal["lock_clocks"] = "lock_clocks"
    gpu_index: Index
    min_mhz: Rank
    max_mhz: Rank


class UnlockClocks(CommandBase):
    kind: Literal["unlock_clocks"] = "unlock_clocks"
    gpu_index: Index


class JobCheckpoint(CommandBase):
    """Ask every rank of ``job`` on this node to checkpoint at ``at_step`` (or next step)."""

    kind: Literal["job_checkpoint"] = "job_checkpoint"
    job: Name
    at_step: NonNegInt | None = None
    #: One number for every node asked at once (the controller's action id). The copies
    #: reach the nodes some steps apart; ranks that agree on the newest number they hold
    #: (``collectives.checkpoint_vote``/``checkpoint_agreed``) take one checkpoint for the
    #: request, not one per copy. ``None``: each copy is a request of its own. At most
    #: 2**53: the ranks' agreement carries it in a float64, exact up to there.
    request: Annotated[int, Field(gt=0, le=2**53)] | None = None


class JobLinkProbe(CommandBase):
    """Run timed send/recv between rank pairs at ``at_step`` (all ranks agree on it)."""

    kind: Literal["job_link_probe"] = "job_link_probe"
    job: Name
    at_step: NonNegInt
    pairs: list[tuple[Rank, Rank]] = Field(max_length=100_000)
    size_bytes: Annotated[int, Field(gt=0, le=1 << 30)] = 8 << 20


class JobDumpTrace(CommandBase):
    """Ask every rank of ``job`` to dump its Flight Recorder buffer (a hang's evidence); the
    ranks answer with ``FlightRecorderDump`` records, even while their training thread is
    stuck in a collective."""

    kind: Literal["job_dump_trace"] = "job_dump_trace"
    job: Name
    incident_id: str = Field(default="", max_length=64, pattern=NO_NUL)


class JobStop(CommandBase):
    kind: Literal["job_stop"] = "job_stop"
    job: Name


class RunPreflight(CommandBase):
    """Run the agent's hardware checks now; the ack says pass/fail and names each failure."""

    kind: Literal["run_preflight"] = "run_preflight"
    expected_nic_rate_gbps: limits.PosFinite | None = Field(
        default=None, description="RDMA ports slower than this fail (default: the node's fastest)"
    )


#: Fault kinds the job-side injector knows (``collectives.faults`` validates each field).
FAULT_KINDS = ("delay", "slowdown", "hang", "crash", "slow_link", "nan")


class FaultSpec(WireModel):
    """One fault for the job-side injector; its other fields are checked by the ranks."""

    model_config = ConfigDict(extra="allow")

    kind: Literal["delay", "slowdown", "hang", "crash", "slow_link", "nan"]


class JobInjectFaults(CommandBase):
    """Chaos drill: add faults to the running ranks of ``job`` (keyed by rank and step)."""

    kind: Literal["job_inject_faults"] = "job_inject_faults"
    job: Name
    faults: list[FaultSpec] = Field(min_length=1, max_length=64)


Command = Annotated[
    SetPowerLimit
    | ResetPowerLimit
    | LockClocks
    | UnlockClocks
    | JobCheckpoint
    | JobLinkProbe
    | JobStop
    | JobInjectFaults
    | RunPreflight
    | JobDumpTrace,
    Field(discriminator="kind"),
]

#: Commands the agent relays to the job's ranks on its local socket.
JobCommand = JobCheckpoint | JobLinkProbe | JobStop | JobInjectFaults | JobDumpTrace

GPU_COMMAND_KINDS = frozenset(
    {"set_power_limit", "reset_power_limit", "lock_clocks", "unlock_clocks"}
)
JOB_COMMAND_KINDS = frozenset(
    {"job_checkpoint", "job_link_probe", "job_stop", "job_inject_faults", "job_dump_trace"}
)


class CommandStatus(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    #: Job-side command handed to the ranks on the node (their outcome follows as records).
    RELAYED = "relayed"


class CommandAck(WireModel):
    command_id: str = Field(min_length=1, max_length=64, pattern=NO_NUL)
    status: CommandStatus
    reason: str = Field(default="", max_length=1024, pattern=NO_NUL)
    finished_unix_s: NonNegFloat = 0.0


# --------------------------------------------------------------------------- report


class Report(WireModel):
    schema_version: Annotated[int, Field(ge=1, le=limits.INT32_MAX)] = SCHEMA_VERSION
    node: NodeIdentity
    agent_instance: str = Field(min_length=1, max_length=64, pattern=NO_NUL)
    seq: NonNegInt
    sent_unix_s: NonNegFloat
    sample_interval_s: limits.PosFinite = 1.0
    samples: list[NodeSample] = Field(default_factory=list, max_length=3_600)
    job: JobRecords = Field(default_factory=JobRecords)
    command_acks: list[CommandAck] = Field(default_factory=list, max_length=4_096)
    spool_dropped_total: NonNegInt = Field(
        default=0, description="Reports the agent's bounded spool had to discard, ever"
    )


class ReportReply(WireModel):
    seq: NonNegInt
    duplicate: bool = False
    commands: list[Command] = Field(default_factory=list)
    server_unix_s: NonNegFloat = 0.0
    peer_groups_unknown: list[PeerGroupRef] = Field(
        default_factory=list,
        max_length=4_096,
        description=(
            "Peer groups the report's summaries named by id that this controller does not know "
            "(it restarted since they were declared): the agent sends them again"
        ),
    )


# --------------------------------------------------------------------------- local socket


class LocalHello(WireModel):
    """First frame a job-side client sends on the agent's Unix socket."""

    type: Literal["hello"] = "hello"
    job: Name
    rank: Rank
    world_size: Annotated[int, Field(ge=1, le=limits.INT32_MAX)]
    pid: Rank
    local_rank: Rank | None = None
    gpu_index: Index | None = Field(
        default=None,
        description=(
            "NVML index the rank claims (TRAINGUARD_GPU_INDEX, else CUDA's device number, "
            "which is relative to CUDA_VISIBLE_DEVICES); gpu_uuid wins over it at the agent"
        ),
    )
    gpu_uuid: str = Field(
        default="",
        max_length=96,
        pattern=NO_NUL,
        description=(
            "NVML UUID of the rank's device (GPU-... or MIG-...; empty on CPU or from an "
            "older rank): the agent maps it to its own NVML index"
        ),
    )
    pod: str = Field(
        default="",
        max_length=253,
        pattern=NO_NUL,
        description="Kubernetes pod of the rank (downward API)",
    )
    namespace: str = Field(
        default="", max_length=63, pattern=NO_NUL, description="Namespace of that pod"
    )
    token: str = Field(
        default="",
        max_length=1024,
        repr=False,
        description=(
            "Job token proving the client may use the agent's TCP endpoint (the Unix socket "
            "is guarded by its file mode and ignores it); never logged or kept by the agent"
        ),
    )

    @model_validator(mode="after")
    def _rank_below_world_size(self) -> LocalHello:
        _rank_in_world(self.rank, self.world_size)
        return self


class LocalRecords(WireModel):
    """A batch of job records; the agent replies with a :class:`LocalReply`."""

    type: Literal["records"] = "records"
    records: JobRecords = Field(default_factory=JobRecords)
    closing: bool = Field(
        default=False,
        description=(
            "The client closes the connection on purpose after this frame (uninstrument or a "
            "clean exit): its disconnect is not a vanished rank"
        ),
    )


class LocalReply(WireModel):
    type: Literal["reply"] = "reply"
    ok: bool = True
    error: str = ""
    #: Job-side commands for this client's job that arrived since its last request.
    commands: list[Command] = Field(default_factory=list)


LocalMessage = Annotated[LocalHello | LocalRecords, Field(discriminator="type")]

__all__ = [
    "API_PREFIX",
    "API_VERSION",
    "FAULT_KINDS",
    "GPU_COMMAND_KINDS",
    "HARDWARE_EVENT_KINDS",
    "JOB_COMMAND_KINDS",
    "MAX_DUMP_GROUPS",
    "MAX_GROUP_RANKS",
    "MAX_REPORT_BYTES",
    "SCHEMA_VERSION",
    "THROTTLE_REASON_BITS",
    "BondMember",
    "BondSample",
    "CheckpointEvent",
    "Command",
    "CommandAck",
    "CommandStatus",
    "EccLocationCounts",
    "FaultSpec",
    "FlightRecorderDump",
    "GpuInfo",
    "GpuSample",
    "HardwareEvent",
    "InflightCollective",
    "JobCheckpoint",
    "JobCommand",
    "JobDumpTrace",
    "JobInjectFaults",
    "JobLinkProbe",
    "JobRecords",
    "JobStop",
    "LocalHello",
    "LocalMessage",
    "LocalRecords",
    "LocalReply",
    "LockClocks",
    "NicInfo",
    "NicPortSample",
    "NodeIdentity",
    "NodeSample",
    "NvLinkSample",
    "PeerGroup",
    "PeerGroupRef",
    "ProbeResult",
    "RankEvent",
    "Report",
    "ReportReply",
    "ResetPowerLimit",
    "RunPreflight",
    "SetPowerLimit",
    "StepSummary",
    "ThrottleReason",
    "UnlockClocks",
    "XidEvent",
    "decode_throttle_reasons",
    "peer_group_id",
]
