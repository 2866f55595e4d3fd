"""Trace-driven, discrete-time replay of a row under a power budget with extra servers.

Each step the simulator (1) applies the commands whose actuation latency has elapsed,
(2) turns every server's uncapped power into its capped power and throughput through the
workload's model (:mod:`power.models`), (3) adds up the row and records violations, and
(4) every ``tick_interval_s`` hands the controller's view (readings as of that instant) to
the policy and schedules the commands it returns. The policy is the same
:class:`~power.policy.PowerPolicy` the controller runs; commands succeed (their failure
paths are unit-tested) and are acknowledged at the next tick.

Each simulated server stands for all its GPUs: one "GPU" per server in the policy's
inventory, carrying the server's summed power, so a cap lands on all eight at once (as a
node-wide command would). Only the row budget is enforced, as in POLCA; the server domains
exist to map readings and get thresholds of 200% so they never act.

Extra servers come from the trace itself: the first ``base + extra`` servers are used, and
if the trace has fewer, the missing ones are copies of earlier servers shifted in time by a
seeded random offset (same diurnal phase, different bursts).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from power.clocks import clock_profile
from power.config import Level, PolicyConfig, Priority
from power.domains import Domain, DomainKind, DomainTree, Reading
from power.errors import ConfigError
from power.models import MODELS
from power.policy import GpuStatus, PowerPolicy
from power.traces import FloatArray, ServerTrace, Trace
from trainguard.wire import (
    CommandAck,
    CommandStatus,
    LockClocks,
    ResetPowerLimit,
    SetPowerLimit,
    UnlockClocks,
)


class Control(StrEnum):
    NONE = "none"
    """No capping at all: the row trips its breaker (a brake event) whenever it hits 100%."""
    POLCA = "polca"
    """The threshold policy (any thresholds: POLCA's, or derived ones)."""
    REACTIVE = "reactive"
    """Priority-blind reactive power capping: power limits on every GPU near the budget."""


@dataclass(kw_only=True, slots=True)
class SimConfig:
    base_servers: int = 40
    extra_servers: int = 0
    server_provisioned_w: float = 4200.0
    row_budget_w: float | None = None
    """Default: ``base_servers * server_provisioned_w``."""
    gpu_model: str = "NVIDIA A100-SXM4-80GB"
    gpus_per_server: int = 8
    control: Control = Control.POLCA
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tick_interval_s: float = 1.0
    """How often the controller sees readings and ticks the policy (agent report period)."""
    actuation_latency_s: float = 0.05
    """Command issued -> GPU clocks changed. In-band NVML is milliseconds; POLCA's
    out-of-band path took up to 40 s."""
    reactive_trigger_frac: float = 0.95
    reactive_target_frac: float = 0.90
    seed: int = 0


@dataclass(slots=True)
class SimResult:
    servers: int
    extra_servers: int
    extra_servers_pct: float
    duration_s: float
    hp_throughput_loss_pct: float
    lp_throughput_loss_pct: float
    p50_latency_impact_pct: float
    p99_latency_impact_pct: float
    time_capped_s: dict[str, float]
    brake_events: int
    budget_violation_s: float
    worst_overshoot_pct: float
    peak_row_frac: float
    commands: int

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _servers_for(trace: Trace, count: int, seed: int) -> list[ServerTrace]:
    if not trace.servers:
        raise ConfigError("simulate: the trace has no servers")
    chosen = list(trace.servers[:count])
    rng = np.random.default_rng(seed + 7919)
    i = 0
    while len(chosen) < count:
        src = trace.servers[i % len(trace.servers)]
        shift = int(rng.integers(60, max(61, trace.n_steps // 4)))
        chosen.append(
            ServerTrace(
                name=f"{src.name}-copy{len(chosen)}",
                priority=src.priority,
                workload=src.workload,
                gpu_power_w=np.roll(src.gpu_power_w, shift),
                other_power_w=np.roll(src.other_power_w, shift),
            )
        )
        i += 1
    return chosen


def _row_tree(names: list[str], budget_w: float, server_w: float, pol: PolicyConfig) -> DomainTree:
    never = dataclasses.replace(pol, t1_frac=2.0, t2_frac=2.0, brake_frac=2.0)
    row = Domain(name="row", kind=DomainKind.ROW, budget_w=budget_w, policy=pol)
    for name in names:
        row.children.append(
            Domain(name=name, kind=DomainKind.SERVER, budget_w=server_w, policy=never, parent=row)
        )
    return DomainTree(row)


def simulate(trace: Trace, cfg: SimConfig) -> SimResult:
    """Replay ``trace`` under ``cfg`` and measure what capping cost and what it prevented."""
    return _Replay(trace, cfg).run()


class _Replay:
    """One simulation run. Stretches where nothing is capped, nothing is in flight and the
    row is below the first threshold are accounted in one vectorized jump: the policy would
    do nothing there, so skipping its ticks changes no outcome."""

    def __init__(self, trace: Trace, cfg: SimConfig) -> None:
        if cfg.base_servers < 1 or cfg.extra_servers < 0:
            raise ConfigError("simulate: base_servers must be >= 1 and extra_servers >= 0")
        if cfg.tick_interval_s <= 0 or cfg.actuation_latency_s < 0:
            raise ConfigError("simulate: tick_interval_s must be > 0, actuation_latency_s >= 0")
        profile = clock_profile(cfg.gpu_model)
        if profile is None or profile.tdp_w is None or profile.power_limit_min_w is None:
            raise ConfigError(f"simulate: GPU model {cfg.gpu_model!r} is not in the clock table")
        self.cfg, self.profile = cfg, profile
        self.pl_min_w = profile.power_limit_min_w * cfg.gpus_per_server
        self.count = cfg.base_servers + cfg.extra_servers
        servers = _servers_for(trace, self.count, cfg.seed)
        self.names = [s.name.lower().replace("_", "-") for s in servers]
        self.budget = cfg.row_budget_w or cfg.base_servers * cfg.server_provisioned_w
        self.dt, self.n = trace.step_s, trace.n_steps
        self.tick_every = max(1, round(cfg.tick_interval_s / trace.step_s))
        self.latency_steps = math.ceil(cfg.actuation_latency_s / trace.step_s - 1e-9)
        # Server level: one simulated "GPU" stands for all the server's GPUs.
        self.tdp = profile.tdp_w * cfg.gpus_per_server
        self.p_gpu = np.stack([s.gpu_power_w for s in servers])
        self.p_other = np.stack([s.other_power_w for s in servers]).sum(axis=0)
        models = [MODELS[s.workload] for s in servers]
        self.sens = np.array([m.clock_sensitivity for m in models])
        self.gamma = np.array([m.power_exponent for m in models])
        self.floor = np.array([m.floor_frac for m in models]) * self.tdp
        self.low = np.array([s.priority is Priority.LOW for s in servers])
        self.inference = np.array([s.workload.value != "training" for s in servers])
        self.activity = np.clip(
            (self.p_gpu - self.floor[:, None]) / (self.tdp - self.floor[:, None]), 0.0, 1.0
        )
        self.row_uncapped = (self.p_gpu.sum(axis=0) + self.p_other) / self.budget
        self.act_hp = self.activity[~self.low].sum(axis=0)
        self.act_lp = self.activity[self.low].sum(axis=0)
        self.act_inf = (self.activity * self.inference[:, None]).sum(axis=0)
        # A command slower than the policy's re-send timeout would be sent twice; real
        # agents acknowledge when done, so the timeout must exceed the actuation latency.
        pol = cfg.policy
        if pol.command_timeout_s <= cfg.actuation_latency_s + cfg.tick_interval_s:
            pol = dataclasses.replace(
                pol, command_timeout_s=2 * (cfg.actuation_latency_s + cfg.tick_interval_s)
            )
        self.policy = PowerPolicy(
            _row_tree(self.names, self.budget, cfg.server_provisioned_w, pol), id_prefix="sim"
        )
        g = cfg.gpus_per_server
        self.inventory = [
            GpuStatus(
                server=name,
                index=0,
                model=cfg.gpu_model,
                priority=s.priority,
                workload=s.workload,
                sm_clock_min_mhz=profile.min_mhz,
                sm_clock_max_mhz=profile.max_mhz,
                power_limit_min_w=self.pl_min_w,
                power_limit_max_w=profile.tdp_w * g,
            )
            for name, s in zip(self.names, servers, strict=True)
        ]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.clock_frac = np.ones(self.count)
        self.limit_w = np.full(self.count, math.inf)
        self.queue: list[tuple[int, int, Callable[[], None]]] = []
        self.seq = 0
        self.acks: list[CommandAck] = []
        self.commands = 0
        self.work_all = np.zeros(2)  # [high, low]
        self.work_done = np.zeros(2)
        self.lat_values: list[FloatArray] = []
        self.lat_weights: list[FloatArray] = []
        self.zero_lat_weight = 0.0
        self.level_time = {lvl.name: 0.0 for lvl in Level if lvl is not Level.NONE}
        self.brake_events = 0
        self.above_brake = False
        self.over_s = 0.0
        self.worst = 0.0
        self.peak = 0.0
        self.reactive_on = False
        self.reactive_target = math.inf
        if cfg.control is Control.POLCA:
            self.quiet = pol.t1_frac - pol.hysteresis_frac
        elif cfg.control is Control.REACTIVE:
            self.quiet = cfg.reactive_trigger_frac
        else:
            self.quiet = math.inf

    # ------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        k = 0
        while k < self.n:
            if self._idle():
                k = self._jump(k)
                if k >= self.n:
                    break
            self._step(k)
            k += 1
        return self._result()

    def _idle(self) -> bool:
        if self.queue or self.acks or self.reactive_on:
            return False
        if self.cfg.control is Control.POLCA and self.policy.level("row") is not Level.NONE:
            return False
        return bool(self.clock_frac.min() >= 1.0 and not np.isfinite(self.limit_w).any())

    def _jump(self, k: int) -> int:
        """Account uncapped steps from ``k`` up to the first tick the controller acts on."""
        frac = self.row_uncapped[k:]
        ticks = (np.arange(k, self.n) % self.tick_every) == 0
        hot = np.flatnonzero(ticks & (frac >= self.quiet))
        end = k + (int(hot[0]) if hot.size else frac.shape[0])
        seg = slice(k, end)
        f = self.row_uncapped[seg]
        if f.size:
            self.peak = max(self.peak, float(f.max()))
            over = f > 1.0
            self.over_s += float(over.sum()) * self.dt
            if over.any():
                self.worst = max(self.worst, float(f[over].max()) - 1.0)
            on = f[ticks[: end - k]] >= 1.0
            if on.size:
                prev = np.concatenate(([self.above_brake], on[:-1]))
                self.brake_events += int((on & ~prev).sum())
                self.above_brake = bool(on[-1])
            self.work_all += (self.act_hp[seg].sum(), self.act_lp[seg].sum())
            self.work_done += (self.act_hp[seg].sum(), self.act_lp[seg].sum())
            self.zero_lat_weight += float(self.act_inf[seg].sum())
        return end

    def _step(self, k: int) -> None:
        while self.queue and self.queue[0][0] <= k:
            heapq.heappop(self.queue)[2]()
        p, floor, gamma = self.p_gpu[:, k], self.floor, self.gamma
        f = self.clock_frac.copy()
        lim = np.isfinite(self.limit_w) & (p > self.limit_w)
        if lim.any():
            ratio = np.clip((self.limit_w[lim] - floor[lim]) / (p[lim] - floor[lim]), 0.0, 1.0)
            f[lim] = np.minimum(f[lim], ratio ** (1.0 / gamma[lim]))
        thr = np.maximum(0.02, 1.0 - self.sens * (1.0 - f))
        a = self.activity[:, k]
        p_eff = np.where(p > floor, floor + (p - floor) * f**gamma, p)
        if lim.any():
            p_eff[lim] = np.minimum(p_eff[lim], self.limit_w[lim])
        row = float(p_eff.sum() + self.p_other[k])
        frac = row / self.budget
        self.peak = max(self.peak, frac)
        if frac > 1.0:
            self.over_s += self.dt
            self.worst = max(self.worst, frac - 1.0)
        # Capacity lost while capped, weighted by how busy the server was: the slowdown a
        # saturated benchmark would show (POLCA's throughput metric), which a lightly
        # loaded server's queue would otherwise hide.
        served = a * thr
        self.work_all += (a[~self.low].sum(), a[self.low].sum())
        self.work_done += (served[~self.low].sum(), served[self.low].sum())
        serving = self.inference & (a > 0)
        if serving.any():
            self.lat_values.append(1.0 / thr[serving] - 1.0)
            self.lat_weights.append(a[serving])
        if k % self.tick_every == 0:
            self._tick(k, row, frac, p_eff)

    # ------------------------------------------------------------------ the controller
    def _tick(self, k: int, row: float, frac: float, p_eff: FloatArray) -> None:
        cfg, now = self.cfg, k * self.dt
        tick_s = self.tick_every * self.dt
        if cfg.control is not Control.POLCA:
            if frac >= 1.0 and not self.above_brake:
                self.brake_events += 1
            self.above_brake = frac >= 1.0
        if cfg.control is Control.NONE:
            return
        if cfg.control is Control.REACTIVE:
            self._reactive(k, frac, tick_s)
            return
        readings = {"row": Reading(row, now)}
        for i, name in enumerate(self.names):
            readings[name] = Reading(float(p_eff[i]), now)
        result = self.policy.tick(now, readings, self.inventory, self.acks)
        self.acks.clear()
        for d in result.decisions:
            self._schedule(
                k,
                _actuate(
                    d.command,
                    self.index[d.node],
                    self.clock_frac,
                    self.limit_w,
                    self.profile.max_mhz,
                    self.acks,
                ),
            )
            self.commands += 1
        lvl = self.policy.level("row")
        if lvl is not Level.NONE:
            self.level_time[lvl.name] += tick_s

    def _reactive(self, k: int, frac: float, tick_s: float) -> None:
        cfg = self.cfg
        release = cfg.reactive_target_frac - cfg.policy.hysteresis_frac
        if frac >= cfg.reactive_trigger_frac or (self.reactive_on and frac > release):
            # Priority-blind: one power limit for every server, sized to the target.
            share = (cfg.reactive_target_frac * self.budget - self.p_other[k]) / self.count
            target = max(self.pl_min_w, min(self.tdp, share))
            target = round(target / 50.0) * 50.0  # no re-send for a few watts' change
            if target != self.reactive_target:
                self._schedule(k, _set_all(self.limit_w, target))
                self.commands += self.count
                self.reactive_target = target
            self.reactive_on = True
            self.level_time["T2_HP"] += tick_s
        elif self.reactive_on:
            self._schedule(k, _set_all(self.limit_w, math.inf))
            self.commands += self.count
            self.reactive_on = False
            self.reactive_target = math.inf

    def _schedule(self, k: int, action: Callable[[], None]) -> None:
        """Land ``action`` after the actuation latency (at least the next step)."""
        self.seq += 1
        heapq.heappush(self.queue, (k + max(1, self.latency_steps), self.seq, action))

    def _result(self) -> SimResult:
        cfg = self.cfg
        brakes = self.policy.brake_events if cfg.control is Control.POLCA else self.brake_events
        values = [*self.lat_values, np.zeros(1)]
        weights = [*self.lat_weights, np.array([self.zero_lat_weight])]
        lat, wts = np.concatenate(values), np.concatenate(weights)
        loss = 100.0 * (1.0 - self.work_done / np.maximum(self.work_all, 1e-12))
        loss = np.where(self.work_all > 0, loss, 0.0)
        return SimResult(
            servers=self.count,
            extra_servers=cfg.extra_servers,
            extra_servers_pct=100.0 * cfg.extra_servers / cfg.base_servers,
            duration_s=self.n * self.dt,
            hp_throughput_loss_pct=float(loss[0]),
            lp_throughput_loss_pct=float(loss[1]),
            p50_latency_impact_pct=100.0 * _wquantile(lat, wts, 0.50),
            p99_latency_impact_pct=100.0 * _wquantile(lat, wts, 0.99),
            time_capped_s=self.level_time,
            brake_events=brakes,
            budget_violation_s=self.over_s,
            worst_overshoot_pct=100.0 * self.worst,
            peak_row_frac=self.peak,
            commands=self.commands,
        )


def _wquantile(values: FloatArray, weights: FloatArray, q: float) -> float:
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    if cum[-1] <= 0:
        return 0.0
    return float(v[min(len(v) - 1, int(np.searchsorted(cum, q * cum[-1])))])


def _set_all(limit_w: FloatArray, value: float) -> Callable[[], None]:
    def apply() -> None:
        limit_w[:] = value

    return apply


def _actuate(
    cmd: LockClocks | UnlockClocks | SetPowerLimit | ResetPowerLimit,
    i: int,
    clock_frac: FloatArray,
    limit_w: FloatArray,
    max_mhz: int,
    acks: list[CommandAck],
) -> Callable[[], None]:
    """The command landing on the GPU; its acknowledgement reaches the next tick."""

    def apply() -> None:
        acks.append(CommandAck(command_id=cmd.id, status=CommandStatus.SUCCEEDED))
        if isinstance(cmd, LockClocks):
            clock_frac[i] = min(1.0, cmd.max_mhz / max_mhz)
        elif isinstance(cmd, UnlockClocks):
            clock_frac[i] = 1.0
        elif isinstance(cmd, SetPowerLimit):
            limit_w[i] = cmd.limit_w
        else:
            limit_w[i] = math.inf

    return apply


def uncapped_row_w(trace: Trace, servers: int, *, seed: int = 0) -> FloatArray:
    """The row's power with ``servers`` servers and nothing capped (as :func:`simulate`
    assembles them), for deriving thresholds from the row that will be run."""
    chosen = _servers_for(trace, servers, seed)
    total: FloatArray = np.zeros(trace.n_steps)
    for s in chosen:
        total += s.gpu_power_w + s.other_power_w
    return total
