#!/bin/bash
# The GPU checks, as one run on a CUDA machine that reaches no package registry (torch, msgpack, uvloop, xxhash,
# numpy, prometheus-client, rich and pytest installed there). pyzmq and lz4 travel as wheels in .whl/, downloaded
# beforehand on a machine that reaches the registry, in the project's root:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pyzmq lz4
#
# Then, there, from the project's root: bash bench/gpu-checks.sh. Each part has its own timeout; logs and JSON go
# to $OUT (default ./gpu-out). Sized for about 7 minutes on one H200 with 16 cores:
#   1. the CUDA tests (pytest -m gpu);
#   2. the training overhead at 1.09 GB of state per rank (90M parameters) on the GPU, at batch 16 and 256;
#   3. the node scenario: 8 ranks of 360 MB each snapshotting back to back;
#   4. the loopback stream of 1 GiB against a raw socket.
set -u
OUT=${OUT:-$(pwd)/gpu-out}; mkdir -p "$OUT"
root=$(pwd)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /dev/shm | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
# The package maps client/, proto/ and bench/ to snapshotd.client, .proto and .bench: lay them out that way in a
# copy, and run everything from that copy (a working directory holding the unmapped snapshotd/ would shadow it).
rm -rf /tmp/proj && cp -r "$root" /tmp/proj && cd /tmp/proj || exit 5
for d in client proto bench; do cp -r "$d" "snapshotd/$d"; done
export PYTHONPATH=/tmp/proj:/tmp/site
python3 -c "import torch, zmq, lz4, snapshotd.client; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 4
B="python3 -m snapshotd.bench.cli"
summary() { grep -E "^(step_ratio|mean_ratio|capture_ms|fence_ms|snapshots_|copy_Bps|saturated_|node_|sidecar_GBps|raw_socket|loopback_ratio)" "$1"; }

echo "== CUDA tests"; SECONDS=0
timeout 150 python3 -m pytest -m gpu tests/client/test_cuda_staging.py -q -p no:cacheprovider -o addopts="" -W ignore \
  2>&1 | tail -20 | tee "$OUT/gpu_tests.log"
echo "(${SECONDS}s)"
for batch in 16 256; do
  echo "== overhead, 90M parameters (1.09 GB of state per rank), batch $batch"; SECONDS=0
  timeout 150 $B overhead --device cuda --scenario saturated --ranks 1 --threads 4 --params 90M --batch $batch \
    --variants none,snapshotd --rounds 2 --steps 8 --json "$OUT/overhead_b$batch.json" > "$OUT/overhead_b$batch.log" 2>&1
  echo "rc=$? (${SECONDS}s)"; summary "$OUT/overhead_b$batch.log"
done
echo "== node: 8 ranks of 360 MB"; SECONDS=0
timeout 120 $B overhead --scenario node --ranks 8 --params 30M --steps 6 --json "$OUT/node.json" > "$OUT/node.log" 2>&1
echo "rc=$? (${SECONDS}s)"; summary "$OUT/node.log"
echo "== transport, loopback, 1 GiB x 5"; SECONDS=0
timeout 90 $B transport --no-links --repeat 5 --json "$OUT/transport.json" > "$OUT/transport.log" 2>&1
echo "rc=$? (${SECONDS}s)"; summary "$OUT/transport.log"
