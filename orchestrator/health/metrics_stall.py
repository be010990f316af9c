"""Stall detection from Triton's TRT-LLM metrics: the executor's heartbeat.

A hung executor keeps /v2/health/ready at 200, but its iteration_counter stops
rising. Active requests with a frozen counter, several scrapes in a row, is a
stall; a frozen counter with nothing active is just an idle instance. Pure
logic: the caller fetches the metrics text and feeds it in.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

GENERAL = "nv_trt_llm_general_metrics"
REQUESTS = "nv_trt_llm_request_metrics"

# One series per model/version (several TRT-LLM models may be served): labels
# other than the metric's own type label identify it.
SeriesKey = tuple[tuple[str, str], ...]


def _key(labels: dict[str, str], type_label: str) -> SeriesKey:
    return tuple(sorted((k, v) for k, v in labels.items() if k != type_label))


def parse(text: str) -> dict[SeriesKey, tuple[float | None, float | None]]:
    """series -> (iteration_counter, active requests); raises ValueError on malformed text."""
    counters: dict[SeriesKey, float] = {}
    active: dict[SeriesKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == GENERAL and sample.labels.get("general_type") == "iteration_counter":
                counters[_key(sample.labels, "general_type")] = sample.value
            elif sample.name == REQUESTS and sample.labels.get("request_type") == "active":
                active[_key(sample.labels, "request_type")] = sample.value
    return {k: (counters.get(k), active.get(k)) for k in counters.keys() | active.keys()}


class StallDetector:
    def __init__(self, observations: int = 3) -> None:
        if observations < 1:
            raise ValueError(f"observations={observations!r}: must be at least 1")
        self.observations = observations
        self._last: dict[SeriesKey, float] = {}
        self._streak: dict[SeriesKey, int] = {}
        self.reason = ""  # why the last observe() said stalled, for logs and `status`

    def observe(self, text: str) -> bool:
        """Feed one scrape; True when a series has had work but no new iteration for N scrapes."""
        try:
            series = parse(text)
        except ValueError:
            # Unreadable metrics say nothing about the executor; the probes and the
            # canary judge the instance. Keep the streaks as they were.
            self.reason = ""
            return False
        for key in list(self._last):
            if key not in series:  # model unloaded: forget it
                self._last.pop(key)
                self._streak.pop(key, None)
        stalled: list[str] = []
        for key, (counter, active) in series.items():
            if counter is None:
                continue
            previous = self._last.get(key)
            self._last[key] = counter
            frozen = previous is not None and counter == previous
            # counter < previous means the server restarted: progress, not a stall.
            if frozen and active is not None and active > 0:
                self._streak[key] = self._streak.get(key, 0) + 1
            else:
                self._streak[key] = 0
            if self._streak[key] >= self.observations:
                name = ",".join(f"{k}={v}" for k, v in key) or "executor"
                stalled.append(f"{name}: iteration_counter stuck at {counter:g} with {active:g} active "
                               f"requests for {self._streak[key]} scrapes")
        self.reason = "; ".join(stalled)
        return bool(stalled)

    def reset(self) -> None:
        """The instance restarted: old counters mean nothing."""
        self._last.clear()
        self._streak.clear()
        self.reason = ""
