#!/usr/bin/env bash
# Runs a command as this project's code would run on an AVX2-only CPU, on a larger x86 CPU: the branches that only
# the AVX2 kind takes (float32 by probe, no AVX-512 builds of our kernels, oneDNN's int8 saturating) get exercised
# on whatever machine a session has. docs/cpu-kinds.md says what it covers and what it cannot.
#
#   tools/avx2_view.sh python -m pytest        # the suite
#   tools/avx2_view.sh quasar-deploy doctor    # what the probes choose there
#
# - oneDNN (torch's float and int8 linears), FBGEMM (torch's dynamic int8 linear) and ATen's vector kernels are capped
#   to AVX2 by their own variables.
# - Our C kernels: a build for AVX-512, AMX or AVX-VNNI becomes a library whose self-check dies of SIGILL, as on a CPU
#   without those instructions; the AVX2 builds are compiled as usual.
# - Kernels are built and probes kept in a cache of the view's own ($QUASAR_CACHE, default under the view's directory
#   $QUASAR_AVX2_VIEW, /tmp/quasar-avx2-view), so the machine's own cache is not mixed with the view's.
# Not capped (no variable exists): ONNX Runtime's kernels (MLAS) keep this CPU's instruction sets. Not modelled: what
# an AVX2 CPU's own library kernels do where the caps make them do otherwise (torch._int_mm saturates under the cap,
# and is exact on an AVX2 CPU); docs/cpu-kinds.md.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: tools/avx2_view.sh COMMAND [ARGS...]" >&2; exit 2; }
view=${QUASAR_AVX2_VIEW:-/tmp/quasar-avx2-view}  # fixed: a kernel's build is cached by its compiler's path
mkdir -p "$view"
real_cc=${CC:-cc}
# Run inside the view already (the suite's test of this tool, under CI's view pass): the compiler it wraps stays the same.
[ "$real_cc" = "$view/cc" ] && real_cc=${QUASAR_AVX2_VIEW_CC:-cc}
export QUASAR_AVX2_VIEW_CC=$real_cc
cat > "$view/cc.$$" <<EOF
#!/bin/sh
# A compiler as an AVX2-only CPU would see its output run: AVX-512, AMX or AVX-VNNI builds fault in their self-check.
output=""; wide=0; previous=""
for argument in "\$@"; do
  case "\$argument" in *avx512*|*amx*|*avxvnni*) wide=1;; esac
  [ "\$previous" = "-o" ] && output="\$argument"
  previous="\$argument"
done
if [ \$wide = 1 ]; then
  source="$view/faults.\$\$.c"
  printf 'int quasar_probe(void) { __builtin_trap(); return 1; }\n' > "\$source"
  $real_cc -shared -fPIC -o "\$output" "\$source"; status=\$?
  rm -f "\$source"
  exit \$status
fi
exec $real_cc "\$@"
EOF
chmod +x "$view/cc.$$"
mv -f "$view/cc.$$" "$view/cc"  # whole, for a build of another process running the view
export CC="$view/cc" ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
export QUASAR_CPU_VIEW=avx2  # bench records made here say so, and the benchmarks page keeps them apart
export QUASAR_CACHE=${QUASAR_CACHE:-$view/cache}
"$@"
