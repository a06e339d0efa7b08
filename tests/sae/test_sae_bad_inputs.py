"""The SAE's Python entry points given what a user plausibly passes by mistake: an SAE folder
whose cfg.json or weights are not what SAELens writes, an SAE that cannot encode, inputs of
another shape, dtype or type. Each is one line naming the file and field (or the width), or is
simply accepted where the meaning is plain (leading dims, float64 and bf16 inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from assay.core.errors import AssayError
from assay.sae.config import SaeArchConfig
from assay.sae.model import SparseAutoencoder
from assay.sae.saelens_format import load_sae

D_IN, D_SAE = 8, 16


def _folder(path: Path, cfg: object) -> Path:
    """An SAE folder with `cfg` as its cfg.json and well-formed weights for d_in 8, d_sae 16."""
    path.mkdir()
    (path / "cfg.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    weights = {
        "W_enc": torch.randn(D_IN, D_SAE, generator=gen),
        "b_enc": torch.zeros(D_SAE),
        "W_dec": torch.randn(D_SAE, D_IN, generator=gen),
        "b_dec": torch.zeros(D_IN),
    }
    save_file(weights, str(path / "sae_weights.safetensors"))
    return path


BASE = {"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE}
TOPK = {**BASE, "architecture": "topk"}


@pytest.mark.parametrize(
    "cfg, message",
    [
        (TOPK, "cfg.json lacks a positive k"),  # no silent k=32
        ({**TOPK, "k": 0}, "cfg.json lacks a positive k"),
        ({**TOPK, "k": -3}, "cfg.json lacks a positive k"),
        ({**TOPK, "k": 64}, "cfg.json's k 64 exceeds its d_sae \\(16 latents\\)"),
        (
            {"architecture": "standard", "d_sae": D_SAE},
            "cfg.json: d_in must be a positive integer; it is missing",
        ),
        ({**BASE, "d_in": None}, "cfg.json: d_in must be a positive integer; got None"),
        ({**BASE, "d_in": 8.5}, "cfg.json: d_in must be a positive integer; got 8.5"),
        ({**BASE, "architecture": "transcoder"}, "cfg.json: d_out must be a positive integer; it is missing"),
        ([1, 2], "cfg.json is not an SAE config: a JSON object, not a list"),
        ({**BASE, "metadata": [1]}, "cfg.json: metadata must be a JSON object"),
        ({**BASE, "metadata": "x"}, "cfg.json: metadata must be a JSON object"),
        ({**BASE, "architecture": ["topk"]}, "cfg.json: architecture must be a name"),
    ],
)
def test_a_cfg_json_that_describes_no_sae_is_one_line_naming_the_field(tmp_path, cfg, message):
    folder = _folder(tmp_path / "sae", cfg)
    with pytest.raises(AssayError, match=message) as caught:
        load_sae(folder)
    assert str(folder) in str(caught.value)


def test_k_is_read_from_either_saelens_layout(tmp_path):
    sae, _ = load_sae(_folder(tmp_path / "v6", {**TOPK, "k": 4}))
    assert sae.arch.k == 4 and int((sae.encode(torch.randn(3, D_IN)) != 0).sum(1).max()) <= 4
    old = {**BASE, "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 5}}  # SAELens < 6
    assert load_sae(_folder(tmp_path / "v5", old))[0].arch.k == 5


def test_damaged_weights_and_a_missing_path_are_one_line(tmp_path):
    folder = _folder(tmp_path / "sae", BASE)
    (folder / "sae_weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(AssayError, match="sae_weights.safetensors is not a readable safetensors file"):
        load_sae(folder)
    with pytest.raises(AssayError, match="load_sae's folder must be a path"):
        load_sae(None)  # type: ignore[arg-type]


def test_an_sae_that_could_not_encode_is_refused_at_construction():
    with pytest.raises(AssayError, match="--k 32 exceeds the SAE's 16 latents"):
        SparseAutoencoder(D_IN, D_SAE, SaeArchConfig())  # topk, k=32 by default
    SparseAutoencoder(D_IN, D_SAE, SaeArchConfig(architecture="relu"))  # relu ignores k
    with pytest.raises(AssayError, match="arch must be an assay.SaeArchConfig"):
        SparseAutoencoder(D_IN, D_SAE, "topk")  # type: ignore[arg-type]
    with pytest.raises(AssayError, match="d_sae must be a positive integer, got -1"):
        SparseAutoencoder(D_IN, -1, SaeArchConfig(k=4))
    with pytest.raises(AssayError, match="d_sae 16 differs from its arch's d_sae 32; give one"):
        SparseAutoencoder(D_IN, D_SAE, SaeArchConfig(k=4, d_sae=32))
    assert SparseAutoencoder(D_IN, D_SAE, SaeArchConfig(k=4, d_sae=D_SAE)).d_sae == D_SAE
    with pytest.raises(AssayError, match="--matryoshka_widths \\[4, 32\\] exceed the SAE's 16 latents"):
        arch = SaeArchConfig(architecture="matryoshka", k=4, matryoshka_widths=[4, 32])
        SparseAutoencoder(D_IN, D_SAE, arch)


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
