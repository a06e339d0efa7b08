"""Fine-tuning and evaluation of causal LMs (used by retraining experiments)."""
