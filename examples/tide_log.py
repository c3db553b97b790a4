"""A harbour master's tide log: parse gauge readings, clean them, and summarise each day.

Readings arrive as lines like "2024-03-07 06:15 2.43" (date, time, water level in metres).
This file is an example for dlm-lsp's demo and replay; the model never trained on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta


@dataclass(frozen=True)
class Reading:
    """One gauge reading."""

    when: datetime
    level: float

    @classmethod
    def parse(cls, line: str) -> "Reading":
        day, clock, level = line.split()
        when = datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M")
        return cls(when, float(level))


@dataclass
class DaySummary:
    """Extremes and mean level of one calendar day."""

    day: str
    high: float
    low: float
    mean: float
    count: int

    @property
    def tidal_range(self) -> float:
        return self.high - self.low


@dataclass
class TideLog:
    """Readings in time order, with the station they came from."""

    station: str
    readings: list[Reading] = field(default_factory=list)

    def add(self, reading: Reading) -> None:
        if self.readings and reading.when <= self.readings[-1].when:
            raise ValueError(f"reading at {reading.when} is not after the last one")
        self.readings.append(reading)

    def load(self, lines: list[str]) -> int:
        added = 0
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            self.add(Reading.parse(line))
            added += 1
        return added

    def between(self, start: datetime, end: datetime) -> list[Reading]:
        return [r for r in self.readings if start <= r.when < end]

    def drop_spikes(self, max_step: float = 0.5) -> int:
        """Removes readings that jump more than max_step metres from both neighbours."""
        kept = self.readings[:1]
        removed = 0
        for prev, cur, nxt in zip(self.readings, self.readings[1:], self.readings[2:]):
            if abs(cur.level - prev.level) > max_step and abs(cur.level - nxt.level) > max_step:
                removed += 1
                continue
            kept.append(cur)
        if len(self.readings) > 1:
            kept.append(self.readings[-1])
        self.readings = kept
        return removed

    def gaps(self, longest: timedelta = timedelta(minutes=30)) -> list[tuple[datetime, datetime]]:
        """Stretches with no reading for longer than `longest`."""
        found = []
        for a, b in zip(self.readings, self.readings[1:]):
            if b.when - a.when > longest:
                found.append((a.when, b.when))
        return found

    def by_day(self) -> dict[str, list[Reading]]:
        days: dict[str, list[Reading]] = {}
        for r in self.readings:
            days.setdefault(r.when.strftime("%Y-%m-%d"), []).append(r)
        return days

    def summaries(self) -> list[DaySummary]:
        out = []
        for day, rows in sorted(self.by_day().items()):
            levels = [r.level for r in rows]
            out.append(DaySummary(day, max(levels), min(levels), sum(levels) / len(levels), len(levels)))
        return out


def turning_points(readings: list[Reading]) -> list[tuple[str, Reading]]:
    """High and low waters: readings higher (or lower) than both neighbours."""
    points = []
    for prev, cur, nxt in zip(readings, readings[1:], readings[2:]):
        if cur.level > prev.level and cur.level >= nxt.level:
            points.append(("high", cur))
        elif cur.level < prev.level and cur.level <= nxt.level:
            points.append(("low", cur))
    return points


def semidiurnal(hours: float, amplitude: float, mean: float, phase: float = 0.0) -> float:
    """Water level of a pure semidiurnal tide (period 12.42 h) at `hours` after the epoch."""
    period = 12.42
    return mean + amplitude * math.cos(2 * math.pi * (hours - phase) / period)


def fit_amplitude(readings: list[Reading]) -> tuple[float, float]:
    """Rough mean level and amplitude: half the spread between the extreme readings."""
    if not readings:
        raise ValueError("no readings")
    levels = [r.level for r in readings]
    mean = sum(levels) / len(levels)
    amplitude = (max(levels) - min(levels)) / 2
    return mean, amplitude


def predict(log: TideLog, hours_ahead: float) -> list[tuple[datetime, float]]:
    """Hourly levels for the next `hours_ahead` hours from a fitted semidiurnal curve."""
    mean, amplitude = fit_amplitude(log.readings)
    start = log.readings[-1].when
    highs = [r for kind, r in turning_points(log.readings) if kind == "high"]
    epoch = highs[-1].when if highs else start
    out = []
    for step in range(1, int(hours_ahead) + 1):
        when = start + timedelta(hours=step)
        hours = (when - epoch).total_seconds() / 3600
        out.append((when, round(semidiurnal(hours, amplitude, mean), 2)))
    return out


def report(log: TideLog) -> str:
    lines = [f"Tide log for {log.station}: {len(log.readings)} readings"]
    for s in log.summaries():
        lines.append(f"  {s.day}  high {s.high:5.2f}  low {s.low:5.2f}  range {s.tidal_range:4.2f}  n={s.count}")
    for start, end in log.gaps():
        lines.append(f"  gap from {start:%H:%M} to {end:%H:%M} on {start:%Y-%m-%d}")
    return "\n".join(lines)


if __name__ == "__main__":
    sample = [
        "2024-03-07 00:00 1.10",
        "2024-03-07 03:00 2.35",
        "2024-03-07 06:00 3.02",
        "2024-03-07 09:00 2.01",
        "2024-03-07 12:00 0.95",
        "2024-03-07 15:00 2.20",
        "2024-03-07 18:00 3.10",
        "2024-03-07 21:00 2.05",
    ]
    log = TideLog("North Pier")
    log.load(sample)
    print(report(log))
    for when, level in predict(log, 6):
        print(f"{when:%H:%M} {level:.2f}")
