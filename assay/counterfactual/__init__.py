"""Counterfactual attribution: what retraining without some examples actually does (the LDS
ground truth), and exact metagradients through a training run."""
