#!/usr/bin/env bash
# Installs kiln's native dependencies on a fresh machine, idempotently:
#   - libtorch from PyPI (torch==2.13.0, the version tch 0.26 pins)
#   - the PJRT CPU plugin from PyPI (xla-cpu-pjrt==0.0.1)
#   - scikit-learn, whose package ships the 8x8 digits data the `train` example reads
# into a virtual environment kept in a user-level cache keyed by the pinned versions,
# so fresh clones and CI runs on the same machine reuse it. The checkout reaches it
# through the git-ignored `.deps/` folder, which `.cargo/config.toml` points at.
set -euo pipefail

TORCH_VERSION=2.13.0
PJRT_CPU_VERSION=0.0.1
SKLEARN_VERSION=1.9.1

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KILN_PYTHON:-python3}"
pyver="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
# KILN_TORCH_DEPS=minimal: torch without its dependencies, plus the two CUDA runtime libraries
# libtorch_cpu.so links (libcudart, libcupti; it loads no other CUDA library): everything kiln's
# Rust code needs (1.2 GB instead of 5.2 GB). Python's `import torch` loads libtorch_cuda and
# every CUDA library, so the test suite's PyTorch reference (tests/zoo.rs) and the scripts need
# the default, full install.
torch_deps="${KILN_TORCH_DEPS:-full}"
case "$torch_deps" in
  full) torch_pkgs=("torch==$TORCH_VERSION"); suffix="" ;;
  minimal) torch_pkgs=("torch==$TORCH_VERSION" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cupti==13.0.85")
           suffix="-minimal" ;;
  *) echo "kiln bootstrap: KILN_TORCH_DEPS must be 'full' or 'minimal', not '$torch_deps'" >&2; exit 1 ;;
esac
key="py${pyver}-torch${TORCH_VERSION}${suffix}-xlacpu${PJRT_CPU_VERSION}-sk${SKLEARN_VERSION}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kiln/${key}"
venv="$cache/venv"
stamp="$cache/.complete"

if [ ! -f "$stamp" ]; then
  echo "kiln bootstrap: installing torch==$TORCH_VERSION ($torch_deps), xla-cpu-pjrt==$PJRT_CPU_VERSION into $venv (first run only)" >&2
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  pkgs=("xla-cpu-pjrt==$PJRT_CPU_VERSION" "scikit-learn==$SKLEARN_VERSION" "safetensors" "numpy")
  if [ "$torch_deps" = minimal ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${torch_pkgs[@]}"
  else
    pkgs+=("${torch_pkgs[@]}")
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pkgs[@]}"
  touch "$stamp"
  echo "kiln bootstrap: installed in $(( $(date +%s) - start )) s" >&2
fi

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
deps="$root/.deps"
mkdir -p "$deps"
# Stable names, independent of the python version, for .cargo/config.toml.
ln -sfn "$venv" "$deps/venv"
ln -sfn "$site/torch" "$deps/libtorch"
ln -sfn "$site/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so" "$deps/pjrt_cpu_plugin.so"
ln -sfn "$site/sklearn/datasets/data" "$deps/sklearn_data"
for f in "$deps/libtorch/lib/libtorch_cpu.so" "$deps/pjrt_cpu_plugin.so"; do
  [ -e "$f" ] || { echo "kiln bootstrap: expected $f after install, not found" >&2; exit 1; }
done
