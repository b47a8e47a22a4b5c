#!/usr/bin/env bash
# Build images and check that each serves: prepare the demo model for the target (quasar-prepare in the cpu image),
# start the server, wait for /health, ask for one completion, stop it (SIGTERM) and check it exited cleanly.
# Needs Docker with BuildKit, and per target its hardware: onnxruntime-gpu and cuda an NVIDIA GPU with the Container
# Toolkit, npu an Ascend host with its driver. From the repository root:
#   bash docker/smoke.sh                    # cpu
#   bash docker/smoke.sh cpu cuda           # any of: cpu onnxruntime-gpu cuda npu
set -euo pipefail

targets=("${@:-cpu}")
demo=/usr/local/lib/python3.11/site-packages/quasar_deploy/demo_model  # inside quasar-deploy:cpu
volume=quasar-smoke-$$
port=${SMOKE_PORT:-18000}
container=

cleanup() {
    [ -n "$container" ] && docker rm -f "$container" >/dev/null 2>&1
    docker volume rm -f "$volume" >/dev/null 2>&1 || true
}
trap cleanup EXIT

run_flags() {
    case $1 in
        cpu) ;;
        onnxruntime-gpu) echo "--gpus 1" ;;
        cuda) echo "--gpus all --ipc=host" ;;
        npu)
            echo "--shm-size=1g --device /dev/davinci0 --device /dev/davinci_manager --device /dev/devmm_svm --device /dev/hisi_hdc"
            echo "-v /usr/local/dcmi:/usr/local/dcmi -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi"
            echo "-v /usr/local/Ascend/driver/lib64:/usr/local/Ascend/driver/lib64"
            echo "-v /usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info"
            echo "-v /etc/ascend_install.info:/etc/ascend_install.info"
            ;;
        *)
            echo "unknown target $1 (cpu, onnxruntime-gpu, cuda, npu)" >&2
            exit 2
            ;;
    esac
}

startup_seconds() {
    case $1 in
        cpu) echo 180 ;;
        onnxruntime-gpu) echo 1200 ;; # TensorRT builds its engine at start
        *) echo 900 ;;
    esac
}

docker build -f docker/cpu/Dockerfile -t quasar-deploy:cpu .
docker volume create "$volume" >/dev/null
for target in "${targets[@]}"; do
    echo "=== $target"
    flags=$(run_flags "$target")
    [ "$target" = cpu ] || docker build -f "docker/$target/Dockerfile" -t "quasar-deploy:$target" .
    docker run --rm -v "$volume:/models" -e QUASAR_CHECKPOINT="$demo" --entrypoint quasar-prepare quasar-deploy:cpu "$target"

    # shellcheck disable=SC2086  # the flags are words
    container=$(docker run -d -p "127.0.0.1:$port:8000" -v "$volume:/models:ro" -e QUASAR_MODEL_NAME=smoke $flags \
        "quasar-deploy:$target" "/models/$target")
    deadline=$((SECONDS + $(startup_seconds "$target")))
    until curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
        if [ "$(docker inspect -f '{{.State.Running}}' "$container")" != true ] || [ $SECONDS -gt $deadline ]; then
            docker logs --tail 50 "$container"
            echo "FAIL $target: /health never answered" >&2
            exit 1
        fi
        sleep 5
    done
    answer=$(curl -fsS "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model": "smoke", "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0}')
    python3 -c 'import json, sys; text = json.loads(sys.argv[1])["choices"][0]["text"]; assert text, "empty completion"; print(repr(text))' \
        "$answer"
    docker stop -t 60 "$container" >/dev/null
    status=$(docker inspect -f '{{.State.ExitCode}}' "$container")
    docker rm "$container" >/dev/null
    container=
    # our server drains and exits 0 (quasar_deploy/serve/server.py); vLLM's exit code on SIGTERM is its own
    case $target in cpu | onnxruntime-gpu) [ "$status" = 0 ] || {
        echo "FAIL $target: exit code $status after SIGTERM" >&2
        exit 1
    } ;;
    esac
    echo "ok $target"
done
