"""Warn at ``instrument()`` when torch's own timeouts would end the job before trainguard acts.

A hang is worth more to the controller than a crash: while the ranks hang, trainguard names
the ranks that never entered the stuck collective (~8 s: the watchdog's threshold plus the
controller's ``hang_timeout_s``), has each rank dump its Flight Recorder buffer, and restarts
without the culprit. If torch kills the job first, all that is left is a crash of every rank
with no culprit. What kills it, and when:

* the process group timeout (``init_process_group(timeout=...)``, ``new_group(timeout=...)``;
  NCCL's default 10 min, gloo's 30 min): NCCL's watchdog aborts the communicator and, with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 3 (3 is the default), tears the process down;
  gloo and ``TORCH_NCCL_BLOCKING_WAIT=1`` raise in the job's thread instead;
* ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (default 480 s): the heartbeat monitor kills a
  process whose NCCL watchdog thread is stuck that long (``TORCH_NCCL_ENABLE_MONITORING=0``
  turns the monitor off).

:func:`timeout_findings` is the pure rule; :func:`check_timeouts` reads the live settings
and logs one WARNING per finding, naming the setting and a value that works.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist

log = logging.getLogger("trainguard.collectives")

NCCL_DEFAULT_HEARTBEAT_S = 480.0


def _flag(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(name, env.get(name.replace("TORCH_", "", 1), default)).strip()


def timeout_findings(
    timeouts_s: Mapping[str, tuple[str, float]],
    env: Mapping[str, str],
    needed_s: float,
) -> list[str]:
    """One line per setting that would end the job within ``needed_s`` of a hang.

    ``timeouts_s``: process-group name -> (backend, timeout in seconds).
    """
    out: list[str] = []
    handling = _flag(env, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    blocking = _flag(env, "TORCH_NCCL_BLOCKING_WAIT", "0").lower() in ("1", "true")
    want = f"timeout=timedelta(seconds={int(needed_s)}) or more"
    for name, (backend, timeout) in sorted(timeouts_s.items()):
        if timeout >= needed_s:
            continue
        if backend == "nccl":
            if blocking:
                how = "TORCH_NCCL_BLOCKING_WAIT=1 makes wait() raise"
            elif handling in ("1", "3"):
                how = f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling} tears the process down"
            else:
                continue  # the collective is aborted, the process lives: trainguard sees it
        else:
            how = f"{backend} raises in the collective"
        out.append(
            f"process group {name!r} ({backend}) times out after {timeout:g} s and {how}: "
            f"a hang ends the job before trainguard can name the culprit and act (it needs "
            f"~{needed_s:g} s); pass {want} to init_process_group/new_group "
            f"(NCCL's default is 600 s)"
        )
    nccl = any(backend == "nccl" for backend, _ in timeouts_s.values())
    monitoring = _flag(env, "TORCH_NCCL_ENABLE_MONITORING", "1").lower() not in ("0", "false")
    raw = _flag(env, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(NCCL_DEFAULT_HEARTBEAT_S))
    try:
        heartbeat = float(raw)
    except ValueError:
        heartbeat = NCCL_DEFAULT_HEARTBEAT_S
    if nccl and monitoring and heartbeat < needed_s:
        out.append(
            f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={raw} kills a rank whose NCCL watchdog is stuck "
            f"that long, before trainguard can act (it needs ~{needed_s:g} s): set it to "
            f"{int(needed_s)} or more (default {NCCL_DEFAULT_HEARTBEAT_S:g})"
        )
    return out


def live_timeouts() -> dict[str, tuple[str, float]]:
    """Process-group name -> (backend, timeout s) of every group this process holds now."""
    out: dict[str, tuple[str, float]] = {}
    world = dist.distributed_c10d._world
    groups = list(getattr(world, "pg_map", {}) or [dist.distributed_c10d._get_default_group()])
    for group in groups:
        name = getattr(group, "group_name", "") or "default"
        seen: set[int] = set()
        for device in getattr(group, "_device_types", [torch.device("cpu")]):
            try:
                backend = group._get_backend(device)
                timeout = backend.options._timeout.total_seconds()
            except (AttributeError, RuntimeError):
                continue
            if id(backend) in seen:  # gloo serves both device types of a group
                continue
            seen.add(id(backend))
            kind = "nccl" if "NCCL" in type(backend).__name__ else "gloo"
            out[name if name not in out else f"{name}/{device.type}"] = (kind, timeout)
    return out


def check_timeouts(needed_s: float, env: Mapping[str, str]) -> list[str]:
    """Log (WARNING) and return the findings for the groups and env of this process."""
    try:
        findings = timeout_findings(live_timeouts(), env, needed_s)
    except Exception:  # a torch without these internals: no advice beats a crash
        log.debug("trainguard: could not read process-group timeouts", exc_info=True)
        return []
    for line in findings:
        log.warning("trainguard: %s", line)
    return findings


__all__ = ["check_timeouts", "live_timeouts", "timeout_findings"]
