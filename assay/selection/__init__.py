"""Data selection: strategies that choose training examples, and the experiments that prove them
by retraining."""
