"""`assay sae train`: a sparse autoencoder on a model's activations at one module."""

from __future__ import annotations

from assay.sae.config import SaeTrainConfig
from assay.sae.train import run_sae_train

Config = SaeTrainConfig
run = run_sae_train
