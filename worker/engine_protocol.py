"""The messages between a GPU worker and its engine process: requests and aborts one way, reports the other.

The worker sends a list of Submit, an Abort or a Stop; the engine process answers Ready (or Failed) once built,
then a Report per step that had something to say, the last one with its final stats, or Failed if a step raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.worker.efficiency import EfficiencyWindow
from sluice.worker.engine import LoRARequest, RequestOutput, RequestRejected, SamplingParams
from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.stats import StepStats
from sluice.worker.fingerprint import Fingerprint


@dataclass
class Submit:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model


@dataclass
class Abort:
    request_id: str


@dataclass
class Stop:
    """Abort everything, send the last report, exit."""


@dataclass
class Ready:
    """The engine is built: what the worker needs to prepare requests without the model."""

    path: str
    config: EngineConfig
    num_kv_blocks: int
    fingerprint: Fingerprint  # what its results' system_fingerprint is derived from
    pinned: bool = False  # the engine process took the CPUs it was offered
    nice: int = 0  # the engine process's nice value
    nice_refused: int | None = None  # the nice value it was to take but was not permitted to


@dataclass
class Failed:
    """Building the engine, or a step, raised this."""

    error: BaseException


@dataclass
class LiveStats:
    """For the live metrics: the engine's state now, and the step that led to it."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    step: StepStats | None = None  # None: no step ran, aborts changed the state
    latencies: list[tuple[float, float]] = field(default_factory=list)  # finished requests' (TTFT, end to end)


@dataclass
class Report:
    finished: list[RequestOutput] = field(default_factory=list)
    rejected: list[tuple[str, RequestRejected]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    live: LiveStats | None = None
    window: EfficiencyWindow | None = None
    final_stats: dict | None = None  # set on the last report: the engine has stopped, nothing follows

    def __bool__(self) -> bool:
        return bool(self.finished or self.rejected or self.cancelled or self.live or self.window
                    or self.final_stats is not None)
