#!/usr/bin/env bash
# What bench/gpu_check.sh needs on the GPU machine and cannot fetch there (it has no network), made
# here: the bundled ABC tunes in .gpu/cache (ASSAY_CACHE there), the wheels of assay's CLI
# dependencies missing from the device image (tyro and its two) in .whl/, bergson's in .whl/peers,
# and SAELens's synthetic generator and trainer in .gpu/synth for bench/sae_synthetic_stream.py.
# Both folders are ignored by git and carried by the device call: carry=[".gpu", ".whl"] (a few MB).
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

# bergson 2.5.1 and what it and the SAELens copy import that the device image lacks (Python 3.12
# there; optree compiled)
mkdir -p .whl/peers
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl/peers \
    bergson==2.5.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 simple-parsing==0.1.9 \
    petname==2.9 natsort==8.4.0 torchopt==0.7.3 optree==0.20.0 graphviz==0.21 einops==0.8.2

# SAELens's synthetic-activation generator and trainer, out of the peers' environment `make
# test-interop` builds (the sae-synthetic step puts it on sys.path, no other step sees it)
"${PEERS_PY:-.venv-peers/bin/python}" bench/saelens_copy.py .gpu/synth
du -sh .gpu/synth
