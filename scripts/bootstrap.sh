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
key="py${pyver}-torch${TORCH_VERSION}-xlacpu${PJRT_CPU_VERSION}-sk${SKLEARN_VERSION}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kiln/${key}"
venv="$cache/venv"
stamp="$cache/.complete"

if [ ! -f "$stamp" ]; then
  echo "kiln bootstrap: installing torch==$TORCH_VERSION, xla-cpu-pjrt==$PJRT_CPU_VERSION into $venv (first run only)" >&2
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "torch==$TORCH_VERSION" "xla-cpu-pjrt==$PJRT_CPU_VERSION" "scikit-learn==$SKLEARN_VERSION" "safetensors" "numpy"
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
