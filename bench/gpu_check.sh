#!/usr/bin/env bash
# GPU readiness check, one prepared run of at most ~10 minutes on one H200: `assay build`'s collector
# against every plain forward+backward floor, `assay score` and `assay sae train` (with and without
# --compile) on CUDA, results as JSON in $OUT (bench/gpu_check.py says what each step does).
#
# Here, with network, once:   bash bench/gpu_prepare.sh        (fills .gpu/ and .whl/, both ignored)
# On the device machine:      run(command="bash bench/gpu_check.sh", carry=[".gpu", ".whl"], timeout_s=600)
# The CPU path of every step:  DEVICE=cpu SMOKE=1 OUT=/tmp/gpu-smoke bash bench/gpu_check.sh
# Some steps only:             ONLY="sae-synthetic" bash bench/gpu_check.sh  (names: bench/gpu_check.py)
# Shorter synthetic training:  SYNTH_SECONDS=15 (assay's training time per SAE; default 30)
#
# The device image has python3 with CUDA torch and transformers but not tyro (assay's CLI) and no
# network: the wheels in .whl/ are installed into /tmp/site, and assay runs from this tree.
set -uo pipefail
export GPU_CHECK_START=${GPU_CHECK_START:-$(date +%s)}  # BUDGET counts from here, installs included
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
if ! "$PY" -c "import tyro" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "tyro is missing and .whl/ has no wheels for it: run bench/gpu_prepare.sh first"; exit 2; }
    export PYTHONPATH=/tmp/site
fi
# bergson for build-smol's side-by-side, and what the SAELens copy imports that the image lacks
# (bench/gpu_prepare.sh downloads them)
PEER=
if ls .whl/peers/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers .whl/peers/*.whl \
        && export PYTHONPATH=/tmp/peers${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "import bergson.__main__" && PEER=$PY || echo "bergson does not import here: build-smol runs without it"
fi
# what the peers import, present or not (the image's package list has not always held)
"$PY" -c "import importlib.util as u; names = 'datasets einops jaxtyping optree pandas peft pyarrow scipy simple_parsing torchopt xxhash'.split(); print('modules missing here:', [n for n in names if u.find_spec(n) is None] or 'none')"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the bundled ABC tunes, prepared here (the device cannot fetch the music21 wheel they come from)
if [ -d .gpu/cache/datasets/abc-tunes ]; then export ASSAY_CACHE=$PWD/.gpu/cache; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
"$PY" bench/gpu_check.py --device "$DEVICE" --out "$OUT" ${SMOKE:+--smoke} ${BUDGET:+--budget "$BUDGET"} ${ONLY:+--only $ONLY} \
    ${PEER:+--peer_python "$PEER"} ${SYNTH_SECONDS:+--synthetic_seconds "$SYNTH_SECONDS"} 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
