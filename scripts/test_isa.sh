#!/usr/bin/env bash
# Runs kiln's numerical tests again with libtorch and XLA restricted to older instruction sets,
# so that a test whose tolerance depends on this machine's CPU fails here, not on another
# machine of the same kind (CPUs differ: Intel or AMD, with or without AVX-512).
#
#   scripts/test_isa.sh            # AVX2 (an AVX2-only AMD EPYC), then SSE4 (no AVX at all)
#   scripts/test_isa.sh avx2       # one of them
#
# What each knob restricts:
#   ATEN_CPU_CAPABILITY   ATen's own vectorised kernels (elementwise, reductions): avx512 | avx2 | default
#   ONEDNN_MAX_CPU_ISA    oneDNN, which runs libtorch's float32 convolutions: AVX512_CORE | AVX2 | SSE41
#   XLA_FLAGS             the XLA CPU plugin's code generation: --xla_cpu_max_isa=AVX512 | AVX2 | SSE4_2
# ONEDNN_MAX_CPU_ISA=AVX2 reproduces exactly the float32 results of an AVX2-only CPU that made
# the zoo gradient tests fail before they compared with float64.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# The tests that compare floating-point results with references.
tests=(--test ops --test autograd --test zoo_grad --test zoo --test conv_lowering --test optim --test train
  --test ffi_kernels --test packed --test fuzz --test mixed_precision --test data_parallel)
run() {
  local name=$1; shift
  echo "== numerical tests restricted to $name: $*"
  env "$@" cargo test --release -p kiln "${tests[@]}"
}
for isa in "${@:-avx2 sse4}"; do
  for one in $isa; do
    case "$one" in
      # On a CPU without AVX-512 the suite's own run already was the AVX2 run.
      avx2) if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
              echo "== numerical tests restricted to AVX2: skipped, this CPU has no AVX-512 (the plain run was the AVX2 run)"
              continue
            fi
            run AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 XLA_FLAGS=--xla_cpu_max_isa=AVX2 ;;
      sse4) run SSE4 ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 ;;
      *) echo "unknown instruction set $one (avx2 | sse4)" >&2; exit 2 ;;
    esac
  done
done
