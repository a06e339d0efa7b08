"""`assay sae eval`: reconstruction and splice metrics of an SAE in SAELens format."""

from __future__ import annotations

from assay.sae.config import SaeEvalConfig
from assay.sae.evaluate import run_sae_eval

Config = SaeEvalConfig
run = run_sae_eval
