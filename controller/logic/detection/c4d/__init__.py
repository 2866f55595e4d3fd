"""C4D-style job detectors: hangs, stragglers and slow communication from collective timing.

Data/tensor/pipeline-parallel training repeats the same collectives every step on every
rank, so ranks that do the same work (a peer group: same role, same reported peers; see
:mod:`.peers`) are each other's baseline: a rank that computes persistently longer than its
peers while waiting less in collectives is a straggler; a collective some ranks entered and
others never reached is a hang whose culprits are the absentees; a job-wide rise in
collective wait with balanced compute is a slow link, localized by a probe round.

Only durations measured on each rank's own monotonic clock are compared across ranks,
never wall-clock timestamps from different nodes, so clock skew cannot fake a straggler.

The detectors are pure: they hold per-job sliding windows in memory, take records and the
controller's clock as input, and return :class:`Finding` values that the incident engine
turns into incidents (deduplicated by ``Finding.key``).
"""

from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.findings import Finding, FindingKind
from controller.logic.detection.c4d.tracker import JobTracker, JobTrackers

__all__ = ["C4DConfig", "Finding", "FindingKind", "JobTracker", "JobTrackers"]
