#!/usr/bin/env bash
# The whole GPU checklist (../shared/GPU_CHECKLIST.md) in ONE device call that ends before a deadline: a lent
# machine has 15 minutes of device time in all, its start takes one or two, so there is one call of about
# nine minutes, not one per section. Run there from the repository root (the device tool's `run`, carry
# [".whl"], after `bash benchmarks/gpu/wheels.sh` here):
#
#     bash benchmarks/gpu/session.sh 540                        # seconds this call may take
#     bash benchmarks/gpu/session.sh 540 checkpoint,step_time   # the timed sections, in this order
#
# Phase 1 runs the two untimed checks side by side (the CUDA test tier, items 1 and 5, and the memory
# planner against max_memory_allocated, item 6: both per-process readings); phase 2 runs the timed ones
# alone, one repeat each, by default in the order step time (item 2), MFU (3), checkpoint stall (4); each
# gets an equal share of the time left when it starts. Everything lands in $OUT/session.tgz (the tool brings back 8 files at most), the result tables
# also as plain files.
set -uo pipefail
OUT=${OUT:-/tmp/out}
budget=${1:-540}
timed=${2:-step_time,mfu,checkpoint}
work=/tmp/gpu_session
mkdir -p "$OUT" "$work"
left() { echo $((budget - SECONDS)); }
finish() {
  tar czf "$OUT/session.tgz" -C "$work" . 2>/dev/null
  cp "$work"/*.md "$work"/device.txt "$OUT/" 2>/dev/null
}
trap finish EXIT
source benchmarks/gpu/prepare.sh "$work/device.txt"

checklist() {  # checklist SECTION SECONDS [more arguments]: one section, stopped after SECONDS
  local section=$1 seconds=$2
  shift 2
  if ((seconds < 30)); then echo "$section: skipped, $seconds s left" | tee -a "$work/skipped.txt"; return; fi
  echo "== $section ($seconds s at most)"
  timeout -k 10 "$seconds" python3 benchmarks/gpu/checklist.py --sections "$section" --results "$work" "$@" \
    >"$work/$section.log" 2>&1
  echo "$section: exit $?" | tee -a "$work/exits.txt"
  tail -n 12 "$work/$section.log"
}

# Phase 1: untimed, side by side (a third of the budget at most).
phase1=$(( $(left) * 2 / 5 ))
echo "== tier and memory ($phase1 s at most)"
# pytest-xdist is in the image: the tests are separate processes on one GPU (35-41 s with -n 10 on an H200).
timeout -k 10 "$phase1" python3 -m pytest tests/test_gpu.py -m requires_cuda -p no:cacheprovider -v -ra -n 10 \
  --timeout 200 >"$work/tier.log" 2>&1 &
tier=$!
checklist memory "$((phase1 - 5))" &
wait "$tier"
echo "tier: exit $?" | tee -a "$work/exits.txt"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$work/tier.log" | tail -n 20
wait

# Phase 2: timed, alone; each section gets an equal share of what is left, less a reserve for packing up.
IFS=, read -ra sections <<<"$timed"
for i in "${!sections[@]}"; do
  checklist "${sections[i]}" "$(( ($(left) - 15) / (${#sections[@]} - i) ))" --repeats 1
done
