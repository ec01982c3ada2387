#!/usr/bin/env bash
# The whole GPU checklist (../shared/GPU_CHECKLIST.md) in ONE device call that ends before a deadline: a lent
# machine has 15 minutes of device time in all, its start takes one or two, so there is one call of about
# nine minutes, not one per section. Run there from the repository root (the device tool's `run`, carry
# [".whl"], after `bash benchmarks/gpu/wheels.sh` here):
#
#     bash benchmarks/gpu/session.sh 540        # seconds this call may take
#
# Three phases, the new measurements first:
#   1. step time, alone (45% of the budget): what a user runs (the CLI with its defaults, in a pseudo-terminal)
#      against a plain PyTorch loop, our FSDP CLI against Lightning's ModelParallelStrategy, our ZeRO-2 against
#      Lightning's (and with Lightning's bucket sizes), then the FSDP CLI with torch.compile against it eager and
#      float8 on top of compile (last: what the phase's time allows); 2 interleaved repeats, the table rewritten
#      after each job
#      so that what ran is kept if the phase runs out;
#   2. the CUDA test tier and the memory planner against max_memory_allocated, side by side (untimed readings);
#   3. the checkpoint stall (sharded first, a half-size model) and MFU, sharing what is left.
# Everything lands in $OUT/session.tgz, the result tables also as plain files (the tool brings back 8 at most).
set -uo pipefail
OUT=${OUT:-/tmp/out}
budget=${1:-540}
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
  tail -n 14 "$work/$section.log"
}

# Phase 1: step time, alone. 7 arms x 2 repeats of 40 steps, about 20 s a job.
checklist step_time "$(( $(left) * 45 / 100 ))" --repeats 2 --strategies cli_ddp,cli_fsdp,zero2,zero2_buckets,compile,float8

# Phase 2: untimed, side by side (pytest-xdist is in the image: 35-41 s with -n 10 on an H200).
phase2=$(( $(left) * 45 / 100 ))
echo "== tier and memory ($phase2 s at most)"
timeout -k 10 "$phase2" python3 -m pytest tests/test_gpu.py -m requires_cuda -p no:cacheprovider -v -ra -n 10 \
  --timeout 200 >"$work/tier.log" 2>&1 &
tier=$!
checklist memory "$((phase2 - 5))" --repeats 1 &
wait "$tier"
echo "tier: exit $?" | tee -a "$work/exits.txt"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$work/tier.log" | tail -n 20
wait

# Phase 3: timed, alone; checkpoint (async arms first) then MFU, less a reserve for packing up.
checklist checkpoint "$(( ($(left) - 15) * 3 / 4 ))" --repeats 1
checklist mfu "$(( $(left) - 15 ))" --repeats 1
