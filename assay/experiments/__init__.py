"""Experiments that join training and attribution: data selection proven by retraining."""
