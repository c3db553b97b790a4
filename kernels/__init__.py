"""Kernels used by engine/: one public function per op, dispatch chosen once at import."""

from kernels.slot_stats import slot_stats

__all__ = ["slot_stats"]
