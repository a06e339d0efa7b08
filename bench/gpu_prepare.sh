#!/usr/bin/env bash
# What bench/gpu_check.sh needs on the GPU machine and cannot fetch there (it has no network), made
# here: the bundled ABC tunes in .gpu/cache (ASSAY_CACHE there), the wheels of assay's CLI
# dependencies missing from the device image (tyro and its two) in .whl/, and SAELens's synthetic
# generator in .gpu/synth for bench/sae_synthetic_stream.py. Both folders are ignored by git and
# carried by the device call: carry=[".gpu", ".whl"] (a few MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .gpu/cache .whl
# what a CPU smoke run (DEVICE=cpu SMOKE=1) cached there would only weigh down the device call
rm -rf .gpu/cache/tokenized .gpu/cache/score-norms
"$PY" -c "from pathlib import Path; from assay.lm.corpora import prepare; print(prepare('abc-tunes', Path('.gpu/cache')))"
# pure-Python wheels, pinned to what .venv runs
for pkg in tyro docstring-parser typeguard; do
    version=$("$PY" -m pip show "$pkg" | sed -n 's/^Version: //p')
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "$pkg==$version"
done
ls -la .gpu/cache/datasets/abc-tunes .whl

# SAELens's synthetic-activation generator, out of the peers' environment `make test-interop` builds
"${PEERS_PY:-.venv-peers/bin/python}" bench/saelens_generator_copy.py .gpu/synth
du -sh .gpu/synth
