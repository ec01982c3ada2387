# Sourced by on_device.sh and session.sh on the lent GPU machine: install the carried wheels (.whl, from
# wheels.sh) beside the image's torch and Lightning, put them and the repository on the import path, and
# record the device and versions in the file named by $1.
#
#     source benchmarks/gpu/prepare.sh "$OUT/device.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "error: could not install the wheels in .whl (run benchmarks/gpu/wheels.sh here first)"; exit 2; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, lightning, deepspeed, lightning_mlopt as m
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}, "
      f"deepspeed {deepspeed.__version__}, lightning_mlopt {m.__version__}")'
} 2>&1 | tee "${1:?name the file for the device and versions}"
