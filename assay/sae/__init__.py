"""Sparse autoencoders on language-model activations."""
