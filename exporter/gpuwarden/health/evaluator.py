"""The health evaluator: keeps each GPU's history between publications and turns each snapshot into verdicts."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import replace

from gpuwarden.health.bottleneck import WindowActivity
from gpuwarden.health.checks import CHECK_FUNCTIONS, NEEDS_SLOW_READINGS, not_read_yet
from gpuwarden.health.context import CRITICAL, CheckContext
from gpuwarden.health.history import CounterHistory, process_running, snapshot_values, window_activity
from gpuwarden.health.state_file import GpuMemory
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.model.snapshot import GpuSnapshot, JobMember, Verdict


class HealthEvaluator:
    """Keeps per-GPU history between publications and turns each snapshot into verdicts."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self._history: dict[str, CounterHistory] = {}
        self._began: dict[tuple[str, str], tuple[int, float]] = {}  # (uuid, check) → (level, began)
        self._since: dict[tuple[str, str], float] = {}
        self._judged: tuple[str, ...] = ()  # the GPUs of the last evaluation: those the state file keeps
        self.links_seen_up: dict[str, set[str]] = {}
        # a short history, with whether a process runs, for each GPU of a multi-GPU job (the job view's window,
        # collective_window_s, ten points): the long one keeps a point per 15 s at the defaults, too coarse to name
        # a straggler within a minute
        self._short: dict[str, tuple[CounterHistory, bool]] = {}

    def _short_shape(self) -> tuple[float, float]:
        window = self.thresholds.collective_window_s
        return max(window / 10, 0.5), window * 1.2 + 1

    def collective_activity(self, uuid: str, now: float) -> WindowActivity | None:
        """What a GPU of a multi-GPU job did over the last collective_window_s (None until it has been watched)."""
        history, running = self._short.get(uuid, (None, False))
        return None if history is None else window_activity(history, running, now, self.thresholds.collective_window_s)

    def history_shape(self) -> tuple[float, float]:
        """(spacing, keep) of each GPU's history: one point per spacing, kept for the longest window the checks
        read, so every window can be judged once it has been watched."""
        limits = self.thresholds
        windows = (
            limits.utilization_for_s,
            limits.thermal_slowdown_for_s,
            limits.thermal_page_window_s,
            limits.power_cap_for_s,
            limits.pstate_for_s,
            limits.nvlink_crc_for_s,
            limits.pcie_replays_for_s,
            limits.bottleneck_window_s,
            900,
        )
        spacing = min(max(min(windows) / 10, 0.5), 15.0)
        return spacing, max(windows) + 2 * spacing

    def _new_history(self) -> CounterHistory:
        return CounterHistory(*self.history_shape())

    def carry_over(self, previous: HealthEvaluator) -> None:
        """Take over what `previous` watched (a reload built this evaluator from new thresholds): each GPU's history,
        resized for this evaluator's windows, and the conditions pending or held. A window longer than the old
        history is judged once the history has grown that long, exactly as after a fresh start with these
        settings; the points already kept count towards it."""
        spacing, keep = self.history_shape()
        for history in previous._history.values():
            history.spacing, history.keep = spacing, keep
        self._history = previous._history
        self._began = previous._began
        self._since = previous._since
        self._judged = previous._judged
        self.links_seen_up = previous.links_seen_up
        spacing, keep = self._short_shape()
        for history, _ in previous._short.values():
            history.spacing, history.keep = spacing, keep
        self._short = previous._short

    def memory(self) -> dict[str, GpuMemory]:
        """What a restart must not forget of the GPUs judged last (written by health/state_file.py)."""
        return {
            uuid: GpuMemory(
                {key: since for (held, key), since in self._since.items() if held == uuid},
                {check: began for (held, check), began in self._began.items() if held == uuid},
                frozenset(self.links_seen_up.get(uuid, ())),
            )
            for uuid in self._judged
        }

    def recall(self, memory: dict[str, GpuMemory]) -> None:
        """Take over what an earlier run remembered (before the first evaluation): a condition that had held its
        window and holds at the first reading fires at once; one that no longer holds is dropped there."""
        for uuid, gpu in memory.items():
            self._since.update({(uuid, key): since for key, since in gpu.held.items()})
            self._began.update({(uuid, check): began for check, began in gpu.levels.items()})
            self.links_seen_up.setdefault(uuid, set()).update(gpu.links_up)

    def held_for(self, uuid: str, key: str, now: float) -> float:
        """Seconds the condition under `key` has held continuously (0 when it does not hold)."""
        since = self._since.get((uuid, key))
        return 0.0 if since is None else now - since

    def sustained(self, uuid: str, key: str, condition: bool, now: float, duration: float) -> bool:
        """True once `condition` has held continuously for `duration` seconds."""
        if not condition:
            self._since.pop((uuid, key), None)
            return False
        since = self._since.setdefault((uuid, key), now)
        return now - since >= duration

    def evaluate(
        self,
        gpus: Iterable[GpuSnapshot],
        xid: dict[tuple[str, int], tuple[int, float]],
        now: float,
        jobs: dict[str, JobMember] | None = None,
        kernel: dict[tuple[str, str, int], tuple[int, float]] | None = None,
    ) -> dict[str, tuple[Verdict, ...]]:
        """Each GPU's verdicts; `kernel`: the kernel log's faults (wall times), of which the NVSwitch SXids are
        judged with each GPU's fabric."""
        result: dict[str, tuple[Verdict, ...]] = {}
        unread: set[tuple[str, str]] = set()
        limits = self.thresholds
        sxids = tuple(
            (device, code, last) for (kind, device, code), (_, last) in sorted((kernel or {}).items()) if kind == "sxid"
        )
        for gpu in gpus:
            if not gpu.up:
                result[gpu.uuid] = (Verdict("gpu_lost", CRITICAL, "critical", gpu.lost_reason or "lost", "gpu_up 1"),)
                continue
            values = snapshot_values(gpu)
            history = self._history.get(gpu.uuid) or self._history.setdefault(gpu.uuid, self._new_history())
            history.add(now, values)
            member = (jobs or {}).get(gpu.uuid)
            peers = member.peers if member is not None else 0
            if peers:  # the same kept readings as the long history, one point per short slot
                short = self._short.get(gpu.uuid, (None, False))[0] or CounterHistory(*self._short_shape())
                short.add_kept(now, history.latest)
                self._short[gpu.uuid] = (short, process_running(values))
            else:
                self._short.pop(gpu.uuid, None)
            exempt = bool(re.fullmatch(limits.pstate_exempt_name_regex, gpu.info.name or ""))
            nvlink = gpu.info.nvlink
            wired = frozenset(str(link) for link, _ in nvlink.remote_bus_ids) if nvlink is not None else frozenset()
            slow_read = "slow" in gpu.updated_at
            unread.update((gpu.uuid, name) for name in NEEDS_SLOW_READINGS if not slow_read)
            result[gpu.uuid] = tuple(
                not_read_yet(name)
                if (gpu.uuid, name) in unread
                else check(
                    CheckContext(name, gpu.uuid, values, history, xid, now, exempt, limits, self, wired, peers, sxids)
                )
                for name, check in CHECK_FUNCTIONS.items()
            )
        self._judged = tuple(result)  # every GPU judged, the lost ones too
        return self._stamp(result, now, unread)

    def _stamp(
        self, result: dict[str, tuple[Verdict, ...]], now: float, unread: Collection[tuple[str, str]] = ()
    ) -> dict[str, tuple[Verdict, ...]]:
        """Carry when each non-ok level began; a level change (warning → critical) starts a new run. A check not
        read yet keeps the start it had (recalled from the state file, or before a late read)."""
        since = {key: self._began[key] for key in unread if key in self._began}
        stamped: dict[str, tuple[Verdict, ...]] = {}
        for uuid, verdicts in result.items():
            out = []
            for verdict in verdicts:
                if verdict.level > 0:
                    level, began = self._began.get((uuid, verdict.check), (verdict.level, now))
                    began = began if level == verdict.level else now
                    since[(uuid, verdict.check)] = (verdict.level, began)
                    verdict = replace(verdict, since=began)
                out.append(verdict)
            stamped[uuid] = tuple(out)
        self._began = since  # GPUs and checks that are gone or ok are forgotten: bounded by the current set
        return stamped
