"""Where an Engine step's wall time goes, per phase, over its pure decoding steps.

A step is schedule → plan → execute → update; the executor times its decoding forward (`StepResult.step_s`:
the draft, the verification and the one host synchronization, captures left out), and everything else a step
does is host work the GPU waits on — the policy's planning and learning, the tokens' bookkeeping, the
detokenizer. On an H100 at 64 × 30K it read AR 21.0 ms forward + 1.2 ms host a step, the automatic policy
16.6 + 5.6 (3.3 of it planning; benchmarks/results/2026-12-07-session35). Only steps that decode and prefill
nothing are counted (a prefill chunk's forward would swamp the host phases), and the captures of a step are left
out of its phases.

    clock = StepClock()
    clock.start(); ...; clock.lap("plan"); ...; clock.finish(counted=True, forward_s=..., capture_s=...)
    StepClock.since(a, b) → {"steps": n, "ms": {phase: mean ms per counted step}, "host_ms": ...}
    (a, b: `clock.snapshot()` before and after)
"""

from __future__ import annotations

import time

# the phases in the order a step runs them (reports list them so)
PHASES = ("schedule", "plan", "forward", "execute_host", "output", "policy", "update", "deltas")


class StepClock:
    def __init__(self) -> None:
        self.steps = 0  # pure decoding steps counted
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._laps: dict[str, float] = {}
        self._t = 0.0

    def start(self) -> None:
        self._laps = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the last lap (or start) belongs to `phase`."""
        now = time.perf_counter()
        self._laps[phase] = self._laps.get(phase, 0.0) + now - self._t
        self._t = now

    def finish(self, counted: bool, forward_s: float = 0.0, capture_s: float = 0.0) -> None:
        """End the step: if `counted`, add its laps — the "execute" lap split into the timed forward
        (`forward_s`) and the executor's host work around it, less `capture_s` of one-time captures."""
        if not counted:
            return
        execute = self._laps.pop("execute", 0.0) - capture_s
        self._laps["forward"] = forward_s
        self._laps["execute_host"] = max(execute - forward_s, 0.0)
        for phase, s in self._laps.items():
            self.seconds[phase] += s
        self.steps += 1

    def snapshot(self) -> dict:
        """{"steps": counted steps, "seconds": {phase: total seconds}} (what `since` differences)."""
        return {"steps": self.steps, "seconds": dict(self.seconds)}

    @staticmethod
    def since(before: dict, after: dict) -> dict:
        """The counted steps between two snapshots: {"steps": n, "ms": {phase: mean ms a step}, "host_ms": the
        mean ms a step outside the timed forward}."""
        n = after["steps"] - before["steps"]
        if n <= 0:
            return {"steps": 0, "ms": {}, "host_ms": None}
        ms = {p: 1e3 * (after["seconds"].get(p, 0.0) - before["seconds"].get(p, 0.0)) / n for p in after["seconds"]}
        return {
            "steps": n,
            "ms": {p: round(v, 3) for p, v in ms.items()},
            "host_ms": round(sum(ms.values()) - ms["forward"], 3),
        }
