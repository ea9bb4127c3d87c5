#!/usr/bin/env bash
# Runs kiln's examples on an NVIDIA GPU through a CUDA PJRT plugin, and prints eager (libtorch
# on the CPU) vs compiled (XLA on the GPU) results and times.
#
#   scripts/gpu_check.sh            # jax-cuda13-pjrt from PyPI (CUDA 13, as torch 2.13's wheels)
#   KILN_GPU_PLUGIN_PACKAGE=jax-cuda12-pjrt scripts/gpu_check.sh
#
# Online (the default): needs an NVIDIA driver (nvidia-smi) and the PyPI registry. Installs
# the plugin and its CUDA libraries into the bootstrap's virtual environment
# (scripts/bootstrap.sh), builds the examples, then runs the `linear` example,
# `infer -- resnet18` and the `train` example with KILN_PJRT_PLUGIN pointing at the plugin.
#
# Offline (a GPU machine with no registry and no Rust toolchain, but a Python that has torch,
# scikit-learn and a jax-cuda*-pjrt plugin installed): build the examples here, against the
# libtorch version that machine's Python has, then run them there:
#
#   LIBTORCH=/path/to/that/torch LIBTORCH_BYPASS_VERSION_CHECK=1 \
#     scripts/gpu_check.sh --prebuild DIR            # on the build machine: builds, copies
#   KILN_GPU_PREBUILT=DIR scripts/gpu_check.sh      # on the GPU machine
#
# The prebuilt binaries load that Python's libtorch (LD_LIBRARY_PATH) and its CUDA libraries;
# KILN_GPU_PYTHON names the Python (default python3), KILN_PJRT_PLUGIN the plugin if not the
# one that Python has installed. The versions must match: tch's C++ glue is compiled against
# libtorch's headers, and binaries built against torch 2.13 fail on torch 2.11's libraries
# ("incoherent element sizes in bytes"). tch 0.26's generated glue names 16 functions that
# torch 2.11 lacks; building against 2.11 needs a copy of torch-sys with those bodies
# replaced (`--config 'patch.crates-io.torch-sys.path="..."'`).
#
# The compiled side's libtorch FFI kernels are CPU-only and stay off on a GPU platform;
# everything else is the same code path as on the CPU plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
examples=(linear infer train)

if [ "${1:-}" = "--prebuild" ]; then
  dir="${2:?--prebuild DIR}"
  [ -n "${LIBTORCH:-}" ] || bash scripts/bootstrap.sh
  cargo build --release --examples
  mkdir -p "$dir"
  for e in "${examples[@]}"; do cp "${CARGO_TARGET_DIR:-target}/release/examples/$e" "$dir/"; done
  echo "gpu_check: copied ${examples[*]} to $dir"
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no nvidia-smi: this machine has no NVIDIA driver" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

prebuilt="${KILN_GPU_PREBUILT:-}"
if [ -n "$prebuilt" ]; then
  py="${KILN_GPU_PYTHON:-python3}"
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  torch_lib="$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
  echo "gpu_check: prebuilt examples from $prebuilt; libtorch $("$py" -c 'import torch; print(torch.__version__)') at $torch_lib" >&2
  export LD_LIBRARY_PATH="${torch_lib}:${LD_LIBRARY_PATH:-}"
  digits="$("$py" -c 'import os, sklearn.datasets as d; print(os.path.join(os.path.dirname(d.__file__), "data", "digits.csv.gz"))')"
  export KILN_DIGITS="$digits"
else
  bash scripts/bootstrap.sh
  package="${KILN_GPU_PLUGIN_PACKAGE:-jax-cuda13-pjrt}"
  version="${KILN_GPU_PLUGIN_VERSION:-0.12.0.1}"
  py=.deps/venv/bin/python
  # The plugin wheel and the CUDA libraries it loads (the matching jax-cuda*-plugin extra
  # pulls the nvidia-* wheels).
  extra_pkg="${package%-pjrt}-plugin[with-cuda]"
  echo "gpu_check: installing $package==$version and $extra_pkg into .deps/venv" >&2
  "$py" -m pip install --quiet --disable-pip-version-check "$package==$version" "$extra_pkg==$version"
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
fi

# KILN_PJRT_PLUGIN, when set, names the plugin; else the one the Python has installed.
plugin="${KILN_PJRT_PLUGIN:-$(find "$site/jax_plugins" -name 'xla_cuda_plugin.so' 2>/dev/null | head -n 1 || true)}"
if [ -z "$plugin" ]; then
  echo "gpu_check: no xla_cuda_plugin.so under $site/jax_plugins" >&2
  exit 1
fi
# The plugin dlopens libcudart, cuBLAS, cuDNN, ... from the nvidia-* wheels.
cuda_libs="$(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | tr '\n' ':' || true)"
export LD_LIBRARY_PATH="${cuda_libs}${LD_LIBRARY_PATH:-}"
export KILN_PJRT_PLUGIN="$plugin"
echo "gpu_check: KILN_PJRT_PLUGIN=$plugin" >&2

if [ -z "$prebuilt" ]; then
  cargo build --release --examples
  prebuilt="${CARGO_TARGET_DIR:-target}/release/examples"
fi
status=0
for run in "linear" "infer resnet18" "train"; do
  echo "== example $run (compiled on the GPU)"
  # shellcheck disable=SC2086
  if ! "$prebuilt"/$run; then
    echo "gpu_check: example $run FAILED" >&2
    status=1
  fi
done
exit $status
