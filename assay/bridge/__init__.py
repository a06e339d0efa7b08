"""Where the pillars meet: attributing a sparse-autoencoder latent to training data.

Imports attribution and sae; neither of them imports this package."""
