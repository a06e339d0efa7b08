"""What trust costs: the model fingerprint (a sha256 of every parameter's bytes) and the index
verification `open_index` runs (files present, sizes, checksums), against `assay score`.

    .venv/bin/python bench/bench_verify.py                      # assay-tiny and the demo's index
    .venv/bin/python bench/bench_verify.py --models assay-tiny smollm2-135m

The index is the one `assay demo` builds (1,500 ABC tunes, bf16, Adafactor normalizer, TrackStar
statistics), built once into --index if missing. The score is the demo's: three held-out
O'Neill tunes, TrackStar, as one `assay score` process would run it (index opened, model and
queries set up, every row scored, results written). Prints the CPU model; figures are of this
machine at this moment (provisional on a shared one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import header  # noqa: E402


def timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of `repeats` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fingerprint_costs(models: list[str], repeats: int) -> None:
    from assay.core.config import ModelConfig
    from assay.core.precision import PrecisionPolicy
    from assay.lm.models import load_model, model_fingerprint

    for name in models:
        for precision in ("fp32", "bf16-pure"):
            model = load_model(ModelConfig(model=name), PrecisionPolicy.resolve(precision, "cpu"))
            size = sum(p.numel() * p.element_size() for p in model.parameters())
            seconds = timed(lambda m=model: model_fingerprint(m), repeats)
            print(f"fingerprint {name} {precision}: {size / 2**20:,.0f} MiB of weights, {seconds:.3f} s")


def ensure_index(folder: Path) -> None:
    from assay.attribution.build import BuildConfig, build_index
    from assay.core.config import DataConfig, ModelConfig

    if (folder / "run.json").exists():
        return
    build_index(
        BuildConfig(
            out=str(folder),
            model=ModelConfig(model="assay-tiny"),
            data=DataConfig(dataset="abc-tunes", max_samples=1500, sample_seed=0, max_length=256),
            normalizer="adafactor",
            normalizer_samples=500,
            preconditioner="trackstar",
            overwrite=True,
        )
    )


def verification_cost(index: Path, repeats: int) -> None:
    import assay
    from assay.commands.score import score_demo

    size = sum(p.stat().st_size for p in index.iterdir())
    fast = timed(lambda: assay.open_index(index), repeats)
    none = timed(lambda: assay.open_index(index, verify="none"), repeats)
    full = timed(lambda: assay.open_index(index, verify="full"), repeats)
    with tempfile.TemporaryDirectory() as tmp:
        score = timed(lambda: score_demo(str(index), str(Path(tmp) / "s"), overwrite=True), repeats)
    verify = fast - none
    print(
        f"index {index} ({size / 2**20:,.1f} MiB): open {none * 1e3:.1f} ms unverified, "
        f"{fast * 1e3:.1f} ms verified (fast), {full * 1e3:.1f} ms (full)"
    )
    print(f"assay score (demo queries): {score:.2f} s; fast verification = {100 * verify / score:.2f}% of it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["assay-tiny"])
    parser.add_argument("--index", default=str(Path.home() / ".cache" / "assay" / "bench" / "demo-index"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{header()}; figures are provisional on a shared machine")
    fingerprint_costs(args.models, args.repeats)
    ensure_index(Path(args.index))
    verification_cost(Path(args.index), args.repeats)


if __name__ == "__main__":
    main()
