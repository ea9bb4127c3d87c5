#!/usr/bin/env bash
# Runs kiln's examples on an NVIDIA GPU through a CUDA PJRT plugin from PyPI, and prints eager
# (libtorch on the CPU) vs compiled (XLA on the GPU) results and times.
#
#   scripts/gpu_check.sh            # jax-cuda13-pjrt (CUDA 13, as torch 2.13's wheels)
#   KILN_GPU_PLUGIN_PACKAGE=jax-cuda12-pjrt scripts/gpu_check.sh
#
# Needs an NVIDIA driver (nvidia-smi) and the PyPI registry. Installs the plugin and its CUDA
# libraries into the bootstrap's virtual environment (scripts/bootstrap.sh), then runs the
# `linear` example, `infer -- resnet18` and the `train` example with KILN_PJRT_PLUGIN pointing
# at the plugin. The compiled side's libtorch FFI kernels are CPU-only and stay off on a GPU
# platform; everything else is the same code path as on the CPU plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
package="${KILN_GPU_PLUGIN_PACKAGE:-jax-cuda13-pjrt}"
version="${KILN_GPU_PLUGIN_VERSION:-0.12.0.1}"
py=.deps/venv/bin/python

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no nvidia-smi: this machine has no NVIDIA driver" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# The plugin wheel and the CUDA libraries it loads (the matching jax-cuda*-plugin extra pulls
# the nvidia-* wheels).
extra_pkg="${package%-pjrt}-plugin[with-cuda]"
echo "gpu_check: installing $package==$version and $extra_pkg into .deps/venv" >&2
"$py" -m pip install --quiet --disable-pip-version-check "$package==$version" "$extra_pkg==$version"

site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
plugin="$(find "$site/jax_plugins" -name 'xla_cuda_plugin.so' | head -n 1)"
if [ -z "$plugin" ]; then
  echo "gpu_check: no xla_cuda_plugin.so under $site/jax_plugins after installing $package" >&2
  exit 1
fi
# The plugin dlopens libcudart, cuBLAS, cuDNN, ... from the nvidia-* wheels.
cuda_libs="$(find "$site/nvidia" -maxdepth 3 -type d -name lib | tr '\n' ':')"
export LD_LIBRARY_PATH="${cuda_libs}${LD_LIBRARY_PATH:-}"
export KILN_PJRT_PLUGIN="$plugin"
echo "gpu_check: KILN_PJRT_PLUGIN=$plugin" >&2

cargo build --release --examples
status=0
for run in "linear" "infer -- resnet18" "train"; do
  echo "== example $run (compiled on the GPU)"
  # shellcheck disable=SC2086
  if ! cargo run --release --quiet --example $run; then
    echo "gpu_check: example $run FAILED" >&2
    status=1
  fi
done
exit $status
