"""Language-model plumbing every pillar shares: models and tokenizers, datasets and batching, hooks,
losses."""
