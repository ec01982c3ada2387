#!/usr/bin/env bash
# Here, before a lent GPU machine is used: the wheels it lacks, into .whl/ (git-ignored; it travels with
# `carry: [".whl"]`). Its image has Python 3.12 with torch, Lightning, torchmetrics, numpy, matplotlib and
# scikit-learn (/work/.library/device/KINDS.md); these are the rest of our dependencies, at the versions
# constraints.txt pins (the ones CI tests). DeepSpeed is published as source only: built here into a
# pure-Python wheel (its CUDA ops compile just in time, there).
#
#     bash benchmarks/gpu/wheels.sh     # then: bash benchmarks/gpu/on_device.sh ... in a device run
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY='deepspeed|hjson|pydantic|pydantic_core|annotated-types|typing-inspection|jsonargparse|docstring_parser'
CARRY+='|typeshed_client|wandb|cwevals|platformdirs|opentelemetry-[a-z-]+|googleapis-common-protos|distro|sniffio'
CARRY+='|torchao'  # the float8 arm (configs/features/float8.yaml)
mapfile -t pins < <(grep -E "^(${CARRY})==" constraints.txt | grep -v '^deepspeed==')
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "${pins[@]}"
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl "$(grep -E '^deepspeed==' constraints.txt)"
ls .whl | wc -l | xargs echo "wheels in .whl:"
du -sh .whl
