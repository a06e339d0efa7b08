"""assay: understand language models through their training data and their features.

The notebook entry points (`import assay`), each also reachable from its module:

    index = assay.build_index(assay.BuildConfig(out="runs/idx", ...))   # or `assay build`
    index = assay.open_index("runs/idx")
    grads = assay.collect_gradients(model, batches, loss_fn)            # any torch model
    result = assay.score(queries, grads, assay.ScoreOptions(mode="trackstar"))
    factors = assay.fit_kfac(model, batches, loss_fn, kind="ekfac")
    scores = assay.kfac_influence(model, train_batches, query_batches, loss_fn)  # [Q, N], any torch model
    lds = assay.linear_datamodel_score(scores, masks, outputs)
    sae, meta = assay.load_sae("runs/sae")                                  # an `assay sae train` OUT

Names are imported on first use, so `import assay` stays instant.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC: dict[str, str] = {
    # attribution
    "BuildConfig": "assay.attribution.build",
    "build_index": "assay.attribution.build",
    "open_index": "assay.attribution.index",
    "GradientIndex": "assay.attribution.index",
    "collect_gradients": "assay.attribution.api",
    "score": "assay.attribution.api",
    "Gradients": "assay.attribution.api",
    "ScoreOptions": "assay.attribution.options",
    "score_index": "assay.attribution.score",
    "fit_kfac": "assay.attribution.kfac_fit",
    "kfac_influence": "assay.attribution.kfac_influence",
    "KronFactors": "assay.attribution.kfac",
    "load_factors": "assay.attribution.kfac",
    "save_factors": "assay.attribution.kfac",
    # training and counterfactuals
    "TrainRecipe": "assay.training.recipe",
    "FinetuneConfig": "assay.training.finetune",
    "finetune": "assay.training.finetune",
    "ValidateConfig": "assay.counterfactual.validate",
    "validate": "assay.counterfactual.validate",
    "GroundTruth": "assay.counterfactual.ground_truth",
    "retrain_subsets": "assay.counterfactual.ground_truth",
    "sample_subsets": "assay.counterfactual.lds",
    "linear_datamodel_score": "assay.counterfactual.lds",
    # sparse autoencoders
    "SparseAutoencoder": "assay.sae.model",
    "SaeArchConfig": "assay.sae.config",
    "load_sae": "assay.sae.saelens_format",
    "save_sae": "assay.sae.saelens_format",
    # configs shared by every command
    "ModelConfig": "assay.core.config",
    "DataConfig": "assay.core.config",
    "RuntimeConfig": "assay.core.config",
    "QueryConfig": "assay.core.config",
    "build_report": "assay.report.command",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    # lazy: the pillars import torch and transformers, which `assay --help` should not wait for
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'assay' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
