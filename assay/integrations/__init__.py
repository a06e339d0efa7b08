"""Gradients collected inside someone else's training loop: a Hugging Face `Trainer` callback
(`GradientCallback`) and a context manager for a plain loop (`record_gradients`). Each writes an
index per chosen step that `assay score --index` reads (attribution/live.py: the arithmetic)."""

from assay.attribution.live import LiveConfig
from assay.integrations.loop import record_gradients
from assay.integrations.trainer import GradientCallback

__all__ = ["GradientCallback", "LiveConfig", "record_gradients"]
