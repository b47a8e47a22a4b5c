#!/usr/bin/env bash
# Build the cpu and onnxruntime-gpu images from this checkout and check that they run (issue 43):
#   cpu:             compose's prepare step (calibrate the demo model, export), the server as a non-root user until its
#                    HEALTHCHECK says healthy, the official openai client (completion, stream, chat), `docker stop`
#                    draining an in-flight stream, the image's size;
#   onnxruntime-gpu: the server on what prepare exported, on ONNX Runtime's CPU provider (no GPU needed to show that
#                    the image's onnxruntime-gpu loads and runs that graph), the openai client, its size.
# Offline-capable: a base image that cannot be pulled is replaced by a stand-in built from Debian's archive
# (debootstrap), and pip's local wheel directory (find-links) and CA bundle reach the builds as a build-time mount
# and a build secret, never copied into an image. Builds and containers use the host's network (no bridge): every
# request of the check goes to 127.0.0.1.
#
#   tools/container_check.sh [--keep-cache]
#
# Runs as root (it starts dockerd if none runs, installing Debian's docker.io if needed, and stops the one it started).
# It removes the containers, volume and images it made; --keep-cache keeps the stand-in base images
# (quasar-deploy-standin/*) and the build cache for the next run (minutes faster); without it they are removed too
# (the daemon's whole build cache: BuildKit's cache cannot be pruned per build). The client needs the openai package: run it in the project's venv (pip install -e '.[test]'), or set PYTHON.
# Exit status: 0 passed, 1 failed, 2 usage, 77 not run because no Docker daemon can run here (the reason is printed).
set -euo pipefail
cd "$(dirname "$0")/.."

NOT_RUN=77
PYTHON=${PYTHON:-python3}
keep_cache=0
for arg in "$@"; do
    case $arg in
        --keep-cache) keep_cache=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "error: unknown argument '$arg' (usage: tools/container_check.sh [--keep-cache])" >&2
            exit 2
            ;;
    esac
done

run=qcheck-$$
work=$(mktemp -d /var/tmp/quasar-container-check.XXXXXX)
volume=$run-models
started=$SECONDS
DOCKER=(docker)
dockerd_pid=
containers=()
images=()

log() { printf '[container-check %4ds] %s\n' $((SECONDS - started)) "$*" >&2; }
die() {
    echo "error: $*" >&2
    exit 1
}
not_run() {
    echo "container check NOT RUN: $*" >&2
    exit "$NOT_RUN"
}
dk() { "${DOCKER[@]}" "$@"; }

cleanup() {
    local status=$?
    set +e
    if [ -n "$dockerd_pid" ] || dk info >/dev/null 2>&1; then
        for container in "${containers[@]}"; do dk rm -f "$container" >/dev/null 2>&1; done
        dk volume rm -f "$volume" >/dev/null 2>&1
        for image in "${images[@]}"; do dk rmi -f "$image" >/dev/null 2>&1; done
        if [ "$keep_cache" = 0 ]; then
            # every stand-in, this run's or an earlier one's, the Debian root last (the others are built on it)
            dk images --format '{{.Repository}}:{{.Tag}}' --filter 'reference=quasar-deploy-standin/*' |
                sort -t/ -k2,2 -r | xargs -r "${DOCKER[@]}" rmi -f >/dev/null 2>&1
            dk builder prune --all --force >/dev/null 2>&1
        fi
    fi
    if [ -n "$dockerd_pid" ]; then
        kill "$dockerd_pid" 2>/dev/null
        wait "$dockerd_pid" 2>/dev/null
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT
# a signal ends the run through the EXIT trap too, so that a stopped check leaves nothing behind
trap 'exit 130' INT
trap 'exit 143' TERM

apt_install() {
    log "installing Debian's $* (apt-get)"
    apt-get update -qq >"$work/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >>"$work/apt.log" 2>&1
}

# --- the daemon and a client that builds with BuildKit

start_daemon() {
    if docker info >/dev/null 2>&1; then
        log "using the Docker daemon that runs here"
        return
    fi
    [ "$(id -u)" = 0 ] || not_run "no Docker daemon runs and starting one needs root"
    if ! command -v dockerd >/dev/null; then
        apt_install docker.io || not_run "dockerd is not installed and docker.io cannot be: $(tail -n 1 "$work/apt.log")"
    fi
    # a pid file left by a dockerd that was killed may name a pid that another process has now: dockerd refuses it
    local pidfile=/var/run/docker.pid
    if [ -f "$pidfile" ] && ! grep -qx dockerd "/proc/$(cat "$pidfile")/comm" 2>/dev/null; then
        rm -f "$pidfile"
    fi
    log "starting dockerd (no bridge network: the check's builds and containers use the host's)"
    dockerd --bridge=none --iptables=false >"$work/dockerd.log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && return
        kill -0 "$dockerd_pid" 2>/dev/null || break
        sleep 1
    done
    local reason
    reason=$(grep -m1 -iE 'level=(fatal|error)' "$work/dockerd.log" || tail -n 1 "$work/dockerd.log")
    kill "$dockerd_pid" 2>/dev/null || true
    dockerd_pid=
    not_run "dockerd cannot start here: ${reason:-no answer within 60 s}"
}

# Our Dockerfiles use RUN --mount, which only BuildKit builds. Docker CLIs from 23 on build with BuildKit through the
# buildx plugin (and fall back to the legacy builder without it); Debian's docker.io CLI (20.10) drives the daemon's
# BuildKit itself when DOCKER_BUILDKIT=1.
pick_client() {
    if docker buildx version >/dev/null 2>&1; then
        return
    fi
    if [ ! -x /usr/bin/docker ]; then
        apt_install docker.io || die "no BuildKit client: docker has no buildx plugin and docker.io cannot be installed"
    fi
    local version
    version=$(/usr/bin/docker version --format '{{.Client.Version}}' 2>/dev/null || true)
    [ "${version%%.*}" -lt 23 ] 2>/dev/null || die "no BuildKit client: docker has no buildx plugin (install docker-buildx)"
    DOCKER=(/usr/bin/docker)
    export DOCKER_BUILDKIT=1
    log "building with Debian's docker CLI $version (BuildKit without buildx)"
}

# --- base images: the real one where it can be had, else a stand-in

# The first `ARG NAME=default` of a Dockerfile.
arg_default() { sed -n "s/^ARG $2=//p" "$1" | head -n 1; }

can_have() { dk image inspect "$1" >/dev/null 2>&1 || timeout 120 "${DOCKER[@]}" pull -q "$1" >/dev/null 2>&1; }

# Debian bookworm from Debian's archive (debootstrap's default mirror), with Python 3.11 and venv: the root of both
# stand-ins.
debian_standin() {
    local tag=quasar-deploy-standin/debian:bookworm rootfs=$work/rootfs
    if dk image inspect "$tag" >/dev/null 2>&1; then
        log "reusing $tag"
        return
    fi
    command -v debootstrap >/dev/null || apt_install debootstrap || die "debootstrap cannot be installed"
    log "debootstrap bookworm (minbase, Python 3.11) for the stand-in bases: a few minutes"
    debootstrap --variant=minbase --include=ca-certificates,netbase,tzdata,python3.11,python3.11-venv,python3-distutils \
        bookworm "$rootfs" >"$work/debootstrap.log" 2>&1 || {
        tail -n 20 "$work/debootstrap.log" >&2
        die "debootstrap failed (its log above)"
    }
    # as an image ships: no package lists or downloads, and none of this host's names
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    : >"$rootfs/etc/resolv.conf"
    echo localhost >"$rootfs/etc/hostname"
    tar --numeric-owner -C "$rootfs" -c . | dk import --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
    rm -rf "$rootfs"
}

# What each stand-in adds to Debian to give our Dockerfiles what they use of the real base (names, paths, tools).
standin_dockerfile() {
    case $1 in
        python:*)
            # python:3.11-slim-bookworm: python, python3, pip, pip3 in /usr/local/bin, packages in
            # /usr/local/lib/python3.11/site-packages (the cpu image's CMD names that path). A venv at /usr/local gives
            # that layout with Debian's Python 3.11, whose system Python stays untouched as the official image's is.
            printf '%s\n' 'FROM quasar-deploy-standin/debian:bookworm' \
                'RUN python3.11 -m venv /usr/local && rm /usr/local/bin/[Aa]ctivate*' \
                'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' 'CMD ["python3"]'
            ;;
        nvcr.io/nvidia/tensorrt:*)
            # NGC's TensorRT image as the onnxruntime-gpu Dockerfile uses it: the system Python with pip3, externally
            # managed (the Dockerfile sets PIP_BREAK_SYSTEM_PACKAGES), useradd. Not its CUDA and TensorRT (the check
            # runs ONNX Runtime's CPU provider) nor its Python 3.12 (Debian bookworm's is 3.11).
            printf '%s\n' 'FROM quasar-deploy-standin/debian:bookworm' \
                'RUN apt-get update && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*' \
                'CMD ["python3"]'
            ;;
        *) return 1 ;;
    esac
}

# base_for TARGET: sets $base to the image TARGET's Dockerfile builds on here.
base_for() {
    local real
    real=$(arg_default "docker/$1/Dockerfile" BASE_IMAGE)
    [ -n "$real" ] || die "docker/$1/Dockerfile has no ARG BASE_IMAGE=..."
    if can_have "$real"; then
        base=$real
        log "$1: base $real"
        return
    fi
    base=quasar-deploy-standin/${real##*/}
    if dk image inspect "$base" >/dev/null 2>&1; then
        log "$1: $real cannot be pulled; reusing the stand-in $base"
        return
    fi
    local recipe
    recipe=$(standin_dockerfile "$real") || die "$real cannot be pulled and there is no stand-in recipe for it"
    debian_standin
    log "$1: $real cannot be pulled; building the stand-in $base"
    printf '%s\n' "$recipe" | dk build --network host -q -t "$base" - >"$work/standin.log" 2>&1 || {
        tail -n 20 "$work/standin.log" >&2
        die "building the stand-in $base failed"
    }
}

# --- package sources for the builds

# pip's local wheel directories (find-links: the environment's, else pip's configuration) as an image holding their
# wheels, mounted by the Dockerfiles while pip runs; sets $wheels_image (scratch: none).
wheels_from_pip() {
    local links dirs=() files=() dir
    links=${PIP_FIND_LINKS:-$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[^ ]*find-links='\(.*\)'$/\1/p" | head -n 1)}
    for dir in $links; do
        dir=${dir#file://}
        [ -d "$dir" ] && dirs+=("$dir")
    done
    wheels_image=scratch
    for dir in "${dirs[@]}"; do
        while IFS= read -r wheel; do files+=(-C "$dir" "$wheel"); done < <(find "$dir" -maxdepth 1 -name '*.whl' -printf '%f\n')
    done
    if [ ${#files[@]} = 0 ]; then
        log "no local wheel directory (pip's find-links): packages come from the indexes only"
        return
    fi
    wheels_image=$run-wheels:local
    tar -c "${files[@]}" | dk import - "$wheels_image" >/dev/null
    images+=("$wheels_image")
    log "local wheels from ${dirs[*]} ($((${#files[@]} / 3)) files) mounted into the builds"
}

# The index torch comes from: the Dockerfile's (PyTorch's CPU index) where it answers, else pip's own index, where
# the local wheels' CPU build (a local version, 2.13.0+cpu) outranks its CUDA build; after the build the check
# makes sure it was the CPU one.
torch_index_for() {
    torch_index=$(arg_default "docker/$1/Dockerfile" TORCH_INDEX_URL)
    if curl -fsS -o /dev/null --max-time 20 "${torch_index%/}/torch/" 2>/dev/null; then
        return
    fi
    torch_index=${PIP_INDEX_URL:-$("$PYTHON" -m pip config get global.index-url 2>/dev/null ||
        "$PYTHON" -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)')}
    log "$1: PyTorch's index does not answer; torch from $torch_index and the local wheels"
}

ca_bundle() {
    local file
    for file in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "$("$PYTHON" -m pip config get global.cert 2>/dev/null || true)"; do
        if [ -n "$file" ] && [ -f "$file" ]; then
            echo "$file"
            return
        fi
    done
}

# The Dockerfile as the builder here can read it: its `# syntax=` image (BuildKit's Dockerfile frontend) comes from a
# registry; where it cannot be pulled, the line is dropped and the daemon's built-in frontend (which has RUN --mount)
# reads the same instructions.
dockerfile_text() {
    local file=docker/$1/Dockerfile frontend
    frontend=$(sed -n '1s/^# syntax=//p' "$file")
    if [ -n "$frontend" ] && ! can_have "$frontend"; then
        log "$1: the Dockerfile frontend $frontend cannot be pulled; building with the daemon's built-in one"
        sed '1{/^# syntax=/d}' "$file"
    else
        cat "$file"
    fi
}

# Step lines of BuildKit's plain progress, each once, as the build goes.
build_progress() { awk '/^#[0-9]+ \[/ && !seen[$0]++ { print "    " substr($0, 1, 140); fflush() }' >&2; }

# build_image TARGET TAG: the image from this checkout, on $base, with the wheels and CA bundle mounted.
build_image() {
    local target=$1 tag=$2 ca args
    base_for "$target"
    torch_index_for "$target"
    ca=$(ca_bundle)
    args=(--network host --progress plain -f - -t "$tag" --build-arg "BASE_IMAGE=$base"
        --build-arg "WHEELS_IMAGE=$wheels_image" --build-arg "TORCH_INDEX_URL=$torch_index")
    [ -z "$ca" ] || args+=(--secret "id=ca-bundle,src=$ca")
    log "$target: building $tag${ca:+ (CA bundle $ca as a build secret)}"
    images+=("$tag")
    dockerfile_text "$target" | dk build "${args[@]}" . 2>&1 | tee "$work/build-$target.log" | build_progress || {
        tail -n 30 "$work/build-$target.log" >&2
        die "building the $target image failed (the end of its log above)"
    }
    dk run --rm --network host --entrypoint python3 "$tag" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' ||
        die "$target: the image's torch is not the CPU build"
    log "$target: built, $(($(dk image inspect -f '{{.Size}}' "$tag") / 1048576)) MiB on $base"
}

# --- running the images

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# serve NAME IMAGE MODEL [docker run options...]: the image's server on 127.0.0.1:$port until its HEALTHCHECK says
# healthy. The check runs every 2 s instead of the image's 30 s (the command is the image's own).
serve() {
    local name=$1 image=$2 model=$3 state
    shift 3
    port=$(free_port)
    containers+=("$name")
    dk run -d --name "$name" --network host --health-interval 2s -v "$volume:/models:ro" \
        -v "$work/chat.jinja:/etc/quasar/chat.jinja:ro" -e QUASAR_CHAT_TEMPLATE=/etc/quasar/chat.jinja \
        -e QUASAR_HOST=127.0.0.1 -e QUASAR_PORT="$port" -e QUASAR_MODEL_NAME=check -e QUASAR_DRAIN_TIMEOUT=120 \
        "$@" "$image" "$model" >/dev/null
    log "$name: serving $model on 127.0.0.1:$port, waiting for the healthcheck"
    for _ in $(seq 300); do
        state=$(dk inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$name")
        case $state in
            "running healthy") break ;;
            running*) sleep 2 ;;
            *)
                dk logs --tail 30 "$name" >&2
                die "$name: the server stopped before it was healthy ($state)"
                ;;
        esac
    done
    [ "$state" = "running healthy" ] || die "$name: not healthy after 600 s ($state)"
    local uid
    uid=$(dk exec "$name" cat /proc/1/status | awk '/^Uid:/ { print $2 }')
    if [ -z "$uid" ] || [ "$uid" = 0 ]; then
        die "$name: the server runs as root"
    fi
    log "$name: healthy, the server runs as uid $uid"
}

client() { "$PYTHON" tools/container_check_client.py "http://127.0.0.1:$port/v1" check "$@"; }

# stop_cleanly NAME: docker stop; the server must exit 0 (drained), not be killed.
stop_cleanly() {
    dk stop -t 120 "$1" >/dev/null
    local code
    code=$(dk inspect -f '{{.State.ExitCode}}' "$1")
    [ "$code" = 0 ] || die "$1: exit code $code after docker stop"
}

check_cpu() {
    local name=$run-cpu
    serve "$name" "$cpu_image" /models/cpu
    client
    log "$name: docker stop during a stream"
    local since out last signalled
    since=$(date +%s)
    out=$(client --drain "${DOCKER[@]}" stop -t 120 "$name")
    echo "$out" | grep -v '^last-event-ns '
    last=$(echo "$out" | sed -n 's/^last-event-ns //p')
    # when the daemon sent SIGTERM: the stream must have ended properly after it, i.e. it was drained, not cut
    signalled=$(dk events --since "$since" --until "$(date +%s)" --filter "container=$name" --filter event=kill \
        --format '{{.TimeNano}}' | head -n 1)
    [ -n "$signalled" ] || die "$name: docker events shows no signal sent to the server"
    [ "$last" -gt "$signalled" ] || die "$name: the stream had ended before docker stop signalled the server"
    [ "$(dk inspect -f '{{.State.ExitCode}}' "$name")" = 0 ] || die "$name: the drained server did not exit 0"
    log "$name: its stream ended properly $(((last - signalled) / 1000000)) ms after SIGTERM; the server exited 0"
}

# The image's own ONNX Runtime (onnxruntime-gpu at its pin) loads the QDQ graph prepare exported and generates with it
# on its CPU provider. `quasar-deploy generate`, not the image's server: serve refuses an export (it serves on layer
# graphs made from an artifact, which run on the CPU provider only).
check_onnxruntime_gpu() {
    local pinned found out
    pinned=$(sed -n 's/^onnxruntime-gpu==//p' docker/onnxruntime-gpu/constraints.txt)
    found=$(dk run --rm --network host --entrypoint python3 "$ort_image" -c 'import onnxruntime; print(onnxruntime.__version__)')
    [ "$found" = "$pinned" ] || die "onnxruntime-gpu: the image has onnxruntime $found, its constraints pin $pinned"
    log "onnxruntime-gpu: generating with /models/onnxruntime-gpu (the QDQ export) on ONNX Runtime $found's CPU provider"
    out=$(dk run --rm --network host -v "$volume:/models:ro" --entrypoint quasar-deploy "$ort_image" generate \
        /models/onnxruntime-gpu --backend onnxruntime --provider cpu --prompt 'def fibonacci(n):' --max-new-tokens 24 --json)
    "$PYTHON" -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["text"], r; print("    generated", repr(r["text"]))' "$out" ||
        die "onnxruntime-gpu: generate gave no text: $out"
}

main() {
    command -v curl >/dev/null || die "curl is needed"
    "$PYTHON" -c 'import openai' 2>/dev/null || die "$PYTHON has no openai package: pip install -e '.[test]' or set PYTHON"
    start_daemon
    pick_client
    wheels_from_pip
    # the tiny models' tokenizer has no chat template: one as tests/serving.py's, so that the chat request runs
    printf '%s' '{% for m in messages %}<|{{ m.role }}|>
{{ m.content }}
{% endfor %}<|assistant|>
' >"$work/chat.jinja"
    chmod 644 "$work/chat.jinja"

    cpu_image=$run-cpu:check
    ort_image=$run-onnxruntime-gpu:check
    build_image cpu "$cpu_image"
    build_image onnxruntime-gpu "$ort_image"

    local demo profile
    demo=$(dk image inspect -f '{{index .Config.Cmd 0}}' "$cpu_image")
    dk volume create "$volume" >/dev/null
    for profile in cpu onnxruntime-gpu; do
        log "prepare $profile: quasar-prepare $profile in the cpu image (compose's prepare-$profile), on $demo"
        dk run --rm --network host -v "$volume:/models" -e QUASAR_CHECKPOINT="$demo" --entrypoint quasar-prepare \
            "$cpu_image" "$profile" 2>&1 | sed 's/^/    /' >&2
    done

    check_cpu
    check_onnxruntime_gpu
    log "image sizes: cpu $(($(dk image inspect -f '{{.Size}}' "$cpu_image") / 1048576)) MiB," \
        "onnxruntime-gpu $(($(dk image inspect -f '{{.Size}}' "$ort_image") / 1048576)) MiB (on their bases here)"
    log "container check passed"
}

main
