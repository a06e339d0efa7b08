"""Training-data attribution: projected per-example gradients, TrackStar scoring, selection."""
