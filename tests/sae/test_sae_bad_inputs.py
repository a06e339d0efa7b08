"""The SAE's Python entry points given what a user plausibly passes by mistake: an SAE that
cannot encode, inputs of another shape, dtype or type. Each is one line naming the width, or is
simply accepted where the meaning is plain (leading dims, float64 and bf16 inputs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.core.errors import AssayError
from assay.sae.config import SaeArchConfig
from assay.sae.model import SparseAutoencoder

D_IN, D_SAE = 8, 16


def test_an_sae_that_could_not_encode_is_refused_at_construction():
    with pytest.raises(AssayError, match="--k 32 exceeds the SAE's 16 latents"):
        SparseAutoencoder(D_IN, D_SAE, SaeArchConfig())  # topk, k=32 by default
    SparseAutoencoder(D_IN, D_SAE, SaeArchConfig(architecture="relu"))  # relu ignores k
    with pytest.raises(AssayError, match="arch must be an assay.SaeArchConfig"):
        SparseAutoencoder(D_IN, D_SAE, "topk")  # type: ignore[arg-type]
    with pytest.raises(AssayError, match="d_sae must be a positive integer, got -1"):
        SparseAutoencoder(D_IN, -1, SaeArchConfig(k=4))


@pytest.mark.parametrize("arch", ["relu", "topk", "batchtopk", "jumprelu", "matryoshka"])
def test_leading_dims_are_flattened_as_reconstruct_does(arch):
    torch.manual_seed(0)
    sae = SparseAutoencoder(D_IN, D_SAE, SaeArchConfig(architecture=arch, k=4))  # type: ignore[arg-type]
    x = torch.randn(2, 3, D_IN)
    z = sae.encode(x)
    assert z.shape == (2, 3, D_SAE)
    torch.testing.assert_close(z, sae.encode(x.reshape(6, D_IN)).reshape(2, 3, D_SAE))
    assert sae.decode(z).shape == (2, 3, D_IN) and sae.encode(x[0, 0]).shape == (D_SAE,)
    torch.testing.assert_close(sae.reconstruct(x), sae.decode(z).detach())


def test_inputs_of_another_dtype_width_or_type():
    torch.manual_seed(0)
    sae = SparseAutoencoder(D_IN, D_SAE, SaeArchConfig(k=4))
    x = torch.randn(3, D_IN)
    torch.testing.assert_close(sae.encode(x.double()), sae.encode(x))  # cast to the weights' dtype
    with pytest.raises(AssayError, match="encode takes \\[..., d_in=8\\], got shape \\[3, 5\\]"):
        sae.encode(torch.randn(3, 5))
    with pytest.raises(AssayError, match="decode takes \\[..., d_sae=16\\], got shape \\[3, 8\\]"):
        sae.decode(x)
    with pytest.raises(AssayError, match="encode takes a torch.Tensor, not a ndarray"):
        sae.encode(np.ones((3, D_IN), np.float32))  # type: ignore[arg-type]


def test_a_transcoder_encodes_bf16_as_an_sae_does():
    torch.manual_seed(0)
    transcoder = SparseAutoencoder(D_IN, D_SAE, SaeArchConfig(architecture="relu"), d_out=6)
    x = torch.randn(3, D_IN).bfloat16()
    torch.testing.assert_close(transcoder.encode(x), transcoder.encode(x.float()))
    assert transcoder.reconstruct(x).dtype == torch.bfloat16
