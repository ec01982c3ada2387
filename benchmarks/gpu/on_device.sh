#!/usr/bin/env bash
# There, on the lent GPU machine, from the repository root (the device tool's `run`, carry [".whl"]):
# install the carried wheels beside the image's torch and Lightning, record the device and versions, then
# run what ../shared/GPU_CHECKLIST.md asks. Everything is written under $OUT, which comes back. A lease has
# 15 minutes of device time: `session.sh` runs all of it in one call; this script runs one part.
#
#     bash benchmarks/gpu/on_device.sh tier                  # pytest -m requires_cuda (items 1 and 5)
#     bash benchmarks/gpu/on_device.sh memory                # checklist.py sections (items 2, 3, 4, 6)
#     bash benchmarks/gpu/on_device.sh step_time,mfu
#     bash benchmarks/gpu/on_device.sh checkpoint
#     bash benchmarks/gpu/on_device.sh step_time ddp,fsdp   # some strategies only (a call has 10 minutes)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/prepare.sh "$OUT/device.txt"
case "${1:?say tier, or checklist sections}" in
  tier) python3 -m pytest tests/test_gpu.py -m requires_cuda -p no:cacheprovider -ra -n 10 2>&1 | tee "$OUT/tier.log" ;;
  *) python3 benchmarks/gpu/checklist.py --sections "$1" ${2:+--strategies "$2"} --results "$OUT" 2>&1 \
       | tee "$OUT/checklist-${1//,/-}.log" ;;
esac
exit "${PIPESTATUS[0]}"
