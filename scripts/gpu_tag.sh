# Sourced by the device scripts: GPU_TAG, the GPU model in record file names (h100, h200, ...; "gpu" if unknown),
# so a call that lands on another kind of machine does not write its records under the wrong name.
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 |
  grep -oiE '[A-Z][0-9]{2,3}[A-Z]?' | head -n 1 | tr '[:upper:]' '[:lower:]')
GPU_TAG=${GPU_TAG:-gpu}
