"""The GPU machine's copy of SAELens and the streamed benchmark that uses it
(bench/saelens_copy.py, bench/sae_synthetic_stream.py), against the installed SAELens: the copy
draws the same world and samples, and the benchmark trains assay's and SAELens's SAEs end to end
on it, with the copy's stand-ins for TransformerLens and W&B ahead of the installed ones (run in
.venv-peers: `make test-interop`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("sae_lens.synthetic")
ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from saelens_copy import copy_saelens  # noqa: E402

DRAW = """
import sys, sae_lens, torch
from safetensors.torch import save_file
sys.path.insert(0, "bench")
from bench_sae_synthetic import synthetic_config
from sae_lens.synthetic import SyntheticModel
model = SyntheticModel(synthetic_config(256, 32, 4, 0))
torch.manual_seed(5)
hidden, feats = model.sample_with_features(64)
save_file({"dictionary": model.feature_dict.feature_vectors.contiguous(), "hidden": hidden,
           "feats": feats.contiguous()}, sys.argv[1])
print(sae_lens.__file__)
"""


def _run(args: list[str], pythonpath: list[Path]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_saelens(tmp_path_factory.mktemp("synth"))


def test_the_copy_draws_what_saelens_draws(copy: Path, tmp_path: Path) -> None:
    used_copy = _run(["-c", DRAW, str(tmp_path / "copy.safetensors")], [copy, ROOT])
    used_installed = _run(["-c", DRAW, str(tmp_path / "installed.safetensors")], [ROOT])
    assert used_copy.strip().startswith(str(copy)) and not used_installed.strip().startswith(str(copy))
    a, b = load_file(tmp_path / "copy.safetensors"), load_file(tmp_path / "installed.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert (a["feats"] > 0).any() and a["hidden"].abs().sum() > 0


def test_the_streamed_benchmark_trains_both_libraries_on_the_copy(copy: Path, tmp_path: Path) -> None:
    args = ["bench/sae_synthetic_stream.py", "--device", "cpu", "--smoke", "--seconds", "1"]
    args += ["--archs", "batchtopk", "jumprelu", "--libraries", "assay", "saelens"]
    _run([*args, "--saelens_path", str(copy), "--out", str(tmp_path)], [ROOT])
    result = json.loads((tmp_path / "synthetic_stream.json").read_text())
    assert result["true_l0"] > 0 and result["generator_samples_per_s"] > 0
    for arch in ("batchtopk", "jumprelu"):
        runs = [result["runs"][f"{library}-{arch}"] for library in ("assay", "saelens")]
        assert runs[0]["samples"] == runs[1]["samples"] >= 12 * 1024, "equal samples"
        assert [r["library"] for r in runs] == ["assay", "saelens"]
        for run in runs:
            metrics = run["metrics"]
            assert run["precision"] == "bf16" and 0 < metrics["mcc"] <= 1 and 0 <= metrics["f1"] <= 1
            assert 0 < metrics["fvu"] < 100 and metrics["l0"] > 0
        assert runs[0]["metrics"]["fvu"] < 1  # assay's; SAELens's can still be above 1 after 12 steps
    for library in ("assay", "saelens"):  # BatchTopK also as SynthSAEBench scores it: L0 = k exactly
        rule = result["runs"][f"{library}-batchtopk"]["metrics"]["training_rule"]
        assert rule["l0"] == result["k"] and 0 <= rule["f1"] <= 1
    assert "training_rule" not in result["runs"]["assay-jumprelu"]["metrics"]


def test_the_copy_is_what_the_benchmark_imports(copy: Path) -> None:
    probe = "import sae_lens as s, transformer_lens as t, wandb as w\n"
    probe += "print(s.__file__, t.__file__, w.__file__)"
    paths = _run(["-c", f"import sys; sys.path.insert(0, {str(copy)!r}); {probe}"], [ROOT]).split()
    assert len(paths) == 3 and all(p.startswith(str(copy)) for p in paths)
