#!/bin/bash
# quasar-ascend-env COMMAND [ARGS...]: run COMMAND in CANN's environment; the npu image's entrypoint, before the server.
#
# vLLM-Ascend's image sets no entrypoint of its own: it keeps that of its base, CANN's image (quay.io/ascend/cann,
# Ascend/cann-container-image), which is bash sourcing three set_env.sh scripts, then exec'ing the command. An image
# that sets its ENTRYPOINT, as ours does (the server), drops that one, and with it CANN's variables: the toolkit's
# (libraries, ASCEND_* paths), the BiSheng compiler's (bishengir, which vLLM-Ascend's Triton kernels compile with) and
# NNAL's (ATB, vLLM-Ascend's fused operators). So this script sources the same three, in the same order, and execs
# the command: the server stays PID 1 and receives the stop signal itself.
#
# The paths are those of CANN's images since 8.5.0 (the one under vLLM-Ascend v0.23.0 is CANN 9.1.0): the BiSheng
# script lies in the versioned CANN home, $ASCEND_TOOLKIT_HOME (/usr/local/Ascend/cann-<version>), which the image
# sets and the toolkit's script exports. NNAL's script takes --cxx_abi where the image sets ATB_CXX_ABI (as CANN
# 9.0.1's entrypoint passes it); without it, it asks the installed torch. QUASAR_ASCEND_ROOT moves /usr/local/Ascend
# (for the test, tests/test_docker.py). A missing script is an error in one line, and the command does not run.

ascend=${QUASAR_ASCEND_ROOT:-/usr/local/Ascend}

# load SCRIPT [ARGS...]: source SCRIPT with ARGS. A script sourced without arguments sees its caller's "$@", and
# NNAL's reads its options from there: sourced from this function, with SCRIPT shifted away, it sees ARGS alone,
# never the server's arguments.
load() {
    script=$1
    shift
    if [ ! -f "$script" ]; then
        echo "error: $script not found: the npu image is built on vLLM-Ascend's image, which has CANN (docker/README.md)" >&2
        exit 1
    fi
    # shellcheck disable=SC1090  # the scripts are CANN's, found at run time
    source "$script" "$@" || {
        echo "error: sourcing $script failed" >&2
        exit 1
    }
}

load "$ascend/ascend-toolkit/set_env.sh"
load "${ASCEND_TOOLKIT_HOME:-}/share/info/ascendnpu-ir/bin/set_env.sh"
load "$ascend/nnal/atb/set_env.sh" ${ATB_CXX_ABI:+"--cxx_abi=$ATB_CXX_ABI"}
exec "$@"
