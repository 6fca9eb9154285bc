#!/usr/bin/env bash
# `tools/gpu_checks.sh OUT [ARTIFACT REQUESTS SCORES]`: what a lent GPU runs, in one command
# (about 5 minutes on one H100; run from the repository root with the GPU's python3 first on
# PATH, JAX with its CUDA plugin, torch, triton). Not part of the suite. Writes into OUT:
#   log.txt       every step's output (the kernel tests, the benchmark, the training run)
#   gpu.json/.md  `python -m benchmarks.gpu` (the figures the README quotes)
#   scores_gpu_art.jsonl  the GPU-trained artifact's scores of REQUESTS (or of 64 generated
#                 requests), scored on the GPU; artifact_gpu.tgz that artifact, so a CPU host
#                 scores it too and the two compare
#   scores_cpu_art.jsonl  ARTIFACT (an export written on another host, e.g. a CPU) scored on the
#                 GPU, compared here with SCORES (that host's scores of the same REQUESTS)
# Steps:
#   1. every Pallas kernel compiled by Triton against the plain loops of tests/reference.py
#      (tests/test_pallas_kernels.py, tests/test_sorted_ids.py with JAX_PLATFORMS=cuda);
#   2. `python -m benchmarks.gpu`: Pallas, XLA, torch (and FBGEMM's TBE when installed) at W1;
#   3. `python -m hybrid.train` on the GPU with two managed-collision tables (LFU), then an
#      int8 export, scored by `python -m hybrid.serving` on the GPU.
set -u -o pipefail
OUT=${1:?usage: tools/gpu_checks.sh OUT [ARTIFACT REQUESTS SCORES]}
ARTIFACT=${2:-}
REQUESTS=${3:-}
SCORES=${4:-}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

step environment
{ nvidia-smi -L; python3 -c "import jax, torch, triton; print('jax', jax.__version__, jax.devices(), \
'torch', torch.__version__, torch.cuda.is_available(), 'triton', triton.__version__)"; } 2>&1 | tee -a "$LOG"

step "1. Pallas kernels compiled by Triton against the reference loops"
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/test_pallas_kernels.py tests/test_sorted_ids.py 2>&1 | tail -40 | tee -a "$LOG"

step "2. python -m benchmarks.gpu"
timeout 300 python3 -m benchmarks.gpu --out "$OUT" 2>&1 | tee -a "$LOG"

step "3. training on the GPU: managed-collision tables (LFU), int8 export, scoring"
WORK=$(mktemp -d)
timeout 180 python3 -m hybrid.train --config configs/synthetic.toml --steps 60 \
  --set 'managed_collision.tables={t_cat_0=256, t_cat_1=256}' \
  --set 'managed_collision.eviction_policy="lfu"' --set "log.metrics_path=\"$WORK/m.jsonl\"" \
  --export "$WORK/art" --quantize int8 2>&1 | tail -8 | tee -a "$LOG"
if [ -z "$REQUESTS" ]; then
  REQUESTS="$WORK/requests.jsonl"
  python3 - "$REQUESTS" <<'EOF'
import json, sys

import numpy as np

rng = np.random.default_rng(0)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        sparse = {f"cat_{j}": rng.integers(0, 1000, int(rng.integers(0, 4))).tolist() for j in range(26)}
        f.write(json.dumps({"dense": rng.random(13).round(4).tolist(), "sparse": sparse}) + "\n")
EOF
fi
python3 -m hybrid.serving --artifact "$WORK/art" --requests "$REQUESTS" \
  --out "$OUT/scores_gpu_art.jsonl" 2>&1 | tail -3 | tee -a "$LOG"
tar -C "$WORK" -czf "$OUT/artifact_gpu.tgz" art
if [ -n "$ARTIFACT" ]; then
  step "3b. an artifact exported on another host, scored on the GPU"
  python3 -m hybrid.serving --artifact "$ARTIFACT" --requests "$REQUESTS" \
    --out "$OUT/scores_cpu_art.jsonl" 2>&1 | tail -3 | tee -a "$LOG"
  if [ -n "$SCORES" ]; then
    python3 - "$SCORES" "$OUT/scores_cpu_art.jsonl" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys

a, b = ([json.loads(x)["score"] for x in open(p)] for p in sys.argv[1:3])
assert len(a) == len(b), (len(a), len(b))
print(f"{len(a)} scores, max |host - GPU| = {max(abs(x - y) for x, y in zip(a, b)):.3g}")
EOF
  fi
fi
step done
