#!/usr/bin/env bash
# Smoke test of the images on a machine with a Docker engine (README, "Deploy: the smoke test").
#
#   bash deploy/smoke.sh             build the cpu and locust images, run one container, check it
#   bash deploy/smoke.sh --compose   build it, run the compose stack on the host network
#                                    (deploy/compose.host.yml: two replicas, proxy, Prometheus)
#
# Every container uses the host network and talks over 127.0.0.1 (no bridge network is created).
# Where an official base image cannot be pulled, a stand-in is built from Debian with debootstrap
# (root needed) and deploy/standin/*.Dockerfile, and the script says so. Where PyTorch's wheel index
# cannot be reached, a folder of wheels holding the pinned torch (POSENC_TORCH_WHEELS, else pip's
# configured find-links) is offered to the build as a simple index on 127.0.0.1.
# Environment: DOCKER (docker), COMPOSE (docker-compose, else `docker compose`), POSENC_IMAGE
# (posenc-serve:cpu), POSENC_DEBIAN_MIRROR (http://deb.debian.org/debian), POSENC_TORCH_WHEELS,
# POSENC_TORCH_INDEX_PORT (47651).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=image
case "${1:-}" in
  "") ;;
  --compose) MODE=compose ;;
  -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
  *) echo "usage: bash deploy/smoke.sh [--compose]" >&2; exit 2 ;;
esac

DOCKER=${DOCKER:-docker}
IMAGE=${POSENC_IMAGE:-posenc-serve:cpu}
LOCUST_IMAGE=${POSENC_LOCUST_IMAGE:-posenc-serve:locust}
PYTHON_IMAGE=python:3.11-slim-bookworm
NGINX_IMAGE=nginx:1.28.0
PROMETHEUS_IMAGE=prom/prometheus:v2.55.1
STANDIN_BASE=posenc-standin/debian:bookworm
TORCH_INDEX=https://download.pytorch.org/whl/cpu
GRACE=10                      # the image's POSENC_GRACE_SECONDS
WORK=$(mktemp -d /tmp/posenc-smoke.XXXXXX)
LOG=$WORK/log
STARTED=$(date +%s)
CLEANUP=()

step() { printf '[smoke] %s\n' "$*"; }
ok() { printf '[smoke]   ok: %s\n' "$*"; }
fail() { printf '[smoke] FAIL: %s\n' "$*" >&2; exit 1; }
cleanup() {
  local i
  for ((i = ${#CLEANUP[@]} - 1; i >= 0; i--)); do eval "${CLEANUP[i]}" > /dev/null 2>&1 || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port_free() { python3 -c 'import socket, sys; s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))' "$1" 2> /dev/null; }
seconds_since() { python3 -c 'import sys, time; print(f"{time.time() - float(sys.argv[1]):.1f}")' "$1"; }
now() { python3 -c 'import time; print(time.time())'; }
# Runs a command with its output in $LOG; on failure prints the end of it.
logged() {
  if ! "$@" > "$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    return 1
  fi
}
image_size_mb() { "$DOCKER" image inspect -f '{{.Size}}' "$1" | awk '{printf "%d MB", $1 / 1e6}'; }
# Runs deploy/smoke_rpc.py in a container of the image under test, on the host network.
rpc() { "$DOCKER" run --rm --network host -v "$PWD/deploy/smoke_rpc.py:/tmp/smoke_rpc.py:ro" "$IMAGE" python /tmp/smoke_rpc.py "$@"; }

# ---- the engine ------------------------------------------------------------------------------------
check_engine() {
  "$DOCKER" info > /dev/null 2>&1 || fail "no Docker engine answers '$DOCKER info' (start dockerd, or set DOCKER)"
  step "engine: Docker $("$DOCKER" version -f '{{.Server.Version}}'), storage driver $("$DOCKER" info -f '{{.Driver}}')"
}

# ---- base images: official when present or pullable, else stand-ins --------------------------------
standin_base() {
  "$DOCKER" image inspect "$STANDIN_BASE" > /dev/null 2>&1 && return
  command -v debootstrap > /dev/null || fail "debootstrap is needed for the stand-ins (apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || fail "debootstrap needs root for the stand-ins"
  local mirror=${POSENC_DEBIAN_MIRROR:-http://deb.debian.org/debian} root=$WORK/rootfs t
  t=$(date +%s)
  step "  debootstrap --variant=minbase bookworm ($mirror)"
  logged debootstrap --variant=minbase bookworm "$root" "$mirror" || fail "debootstrap failed"
  # As Docker's Debian images: services never start inside a build, no man pages or docs.
  printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d" && chmod +x "$root/usr/sbin/policy-rc.d"
  printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/locale/*\n' \
    > "$root/etc/dpkg/dpkg.cfg.d/docker-minimal"
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
    "$mirror" "$mirror" > "$root/etc/apt/sources.list"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | "$DOCKER" import --change 'CMD ["bash"]' - "$STANDIN_BASE" > /dev/null
  rm -rf "$root"
  ok "Debian base $STANDIN_BASE in $(( $(date +%s) - t )) s"
}
# Prints the image to build FROM for an official image: itself if it is here or can be pulled,
# else a stand-in built from deploy/standin/<name>.Dockerfile.
base_image() {
  local official=$1 name=$2 standin="posenc-standin/$2:bookworm" context t
  if "$DOCKER" image inspect "$official" > /dev/null 2>&1 || timeout 120 "$DOCKER" pull -q "$official" > /dev/null 2>&1; then
    step "base image: $official (official)" >&2
    echo "$official"
    return
  fi
  step "base image: $official cannot be pulled here (no registry access): building the stand-in $standin" >&2
  standin_base >&2
  context=$WORK/standin-$name
  mkdir -p "$context"
  # The host's CA bundle, so pip inside the build trusts what the host trusts.
  cp /etc/ssl/certs/ca-certificates.crt "$context/" 2> /dev/null || : > "$context/ca-certificates.crt"
  t=$(date +%s)
  logged "$DOCKER" build --network host -f "deploy/standin/$name.Dockerfile" --build-arg "BASE=$STANDIN_BASE" \
    -t "$standin" "$context" >&2 || fail "stand-in $standin did not build"
  ok "stand-in $standin ($(image_size_mb "$standin")) in $(( $(date +%s) - t )) s" >&2
  echo "$standin"
}

# ---- the torch index for the export stage -----------------------------------------------------------
torch_index() {  # sets INDEX_URL
  if curl -fsS --max-time 20 -o /dev/null "$TORCH_INDEX/torch/" 2> /dev/null; then
    step "torch index: $TORCH_INDEX"
    INDEX_URL=$TORCH_INDEX
    return
  fi
  local version wheels wheel port index=$WORK/index
  version=$(sed -n 's/.*"torch==\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)
  wheels=${POSENC_TORCH_WHEELS:-$(pip config get global.find-links 2> /dev/null || true)}
  wheel=$(ls "$wheels"/torch-"$version"+cpu-cp311-*.whl 2> /dev/null | head -n 1 || true)
  [ -n "$wheel" ] || fail "$TORCH_INDEX cannot be reached and no torch-$version+cpu wheel was found (set POSENC_TORCH_WHEELS to a folder holding it)"
  mkdir -p "$index/simple/torch" "$index/files"
  ln -s "$wheel" "$index/files/"
  printf '<!DOCTYPE html><html><body><a href="../../files/%s#sha256=%s">%s</a></body></html>\n' \
    "$(basename "$wheel")" "$(sha256sum "$wheel" | cut -d' ' -f1)" "$(basename "$wheel")" > "$index/simple/torch/index.html"
  # A fixed port where it is free: the URL is a build arg of the export stage, so a new one each
  # run would rebuild torch's layer and the export every time.
  port=${POSENC_TORCH_INDEX_PORT:-47651}
  port_free "$port" || port=$(free_port)
  python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" > "$WORK/index.log" 2>&1 &
  CLEANUP+=("kill $!")
  for _ in $(seq 50); do curl -fs -o /dev/null "http://127.0.0.1:$port/simple/torch/" && break; sleep 0.1; done
  step "torch index: $TORCH_INDEX cannot be reached: serving $(basename "$wheel") from $wheels on 127.0.0.1:$port"
  INDEX_URL=http://127.0.0.1:$port/simple
}

# ---- build ------------------------------------------------------------------------------------------
build() {
  local python_base t user uid
  python_base=$(base_image "$PYTHON_IMAGE" python)
  torch_index
  step "build: docker build --network host --target cpu -t $IMAGE ."
  t=$(date +%s)
  logged "$DOCKER" build --network host --target cpu -t "$IMAGE" \
    --build-arg "PYTHON_IMAGE=$python_base" --build-arg "TORCH_INDEX=$INDEX_URL" . || fail "the cpu image did not build"
  BUILD_SECONDS=$(( $(date +%s) - t ))
  SIZE=$(image_size_mb "$IMAGE")
  ok "$IMAGE built in $BUILD_SECONDS s (layers already built are reused), $SIZE"

  step "image: runs as non-root, has no torch"
  user=$("$DOCKER" image inspect -f '{{.Config.User}}' "$IMAGE")
  uid=$("$DOCKER" run --rm --network none "$IMAGE" id -u)
  [ "$uid" != 0 ] || fail "the image runs as root"
  ok "USER $user, id -u $uid"
  if "$DOCKER" run --rm --network none "$IMAGE" python -c 'import torch' > /dev/null 2>&1; then fail "torch imports in $IMAGE"; fi
  ok "import torch fails"
  PYTHON_BASE=$python_base
}

build_locust() {
  local t
  step "build: docker build --network host --target locust -t $LOCUST_IMAGE ."
  t=$(date +%s)
  logged "$DOCKER" build --network host --target locust -t "$LOCUST_IMAGE" \
    --build-arg "PYTHON_IMAGE=$PYTHON_BASE" --build-arg "TORCH_INDEX=$INDEX_URL" . || fail "the locust image did not build"
  ok "$LOCUST_IMAGE built in $(( $(date +%s) - t )) s, $(image_size_mb "$LOCUST_IMAGE")"
}

# ---- one container ----------------------------------------------------------------------------------
http_api() {  # BASE_URL: the OpenAI-compatible API answers /health, /v1/models and one /v1/completions
  local base=$1 models completion
  step "HTTP API: GET $base/health, GET $base/v1/models, POST $base/v1/completions"
  curl -fsS --max-time 10 "$base/health" > /dev/null || fail "GET /health"
  models=$(curl -fsS --max-time 10 "$base/v1/models" \
    | python3 -c 'import json, sys; print(" ".join(m["id"] for m in json.load(sys.stdin)["data"]))') \
    || fail "GET /v1/models"
  [[ " $models " == *" alibi "* ]] || fail "/v1/models lists no alibi: $models"
  completion=$(curl -fsS --max-time 60 "$base/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "alibi", "prompt": "def fibonacci(n):\n", "max_tokens": 16, "temperature": 0, "ignore_eos": true}' \
    | python3 -c 'import json, sys; r = json.load(sys.stdin); print(r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"])') \
    || fail "POST /v1/completions"
  [ "$completion" = "16 length" ] || fail "/v1/completions: completion_tokens and finish_reason are '$completion', not '16 length'"
  ok "models: $models; a completion of 16 tokens (finish_reason length)"
}

wait_healthy() {  # NAME TIMEOUT: prints the seconds it took
  local start=$1 name=$2 timeout=$3 status
  while true; do
    status=$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$name")
    [ "$status" = healthy ] && break
    [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$name")" = true ] || { "$DOCKER" logs --tail 30 "$name" >&2; fail "$name exited"; }
    (( $(date +%s) - ${start%.*} < timeout )) || { "$DOCKER" logs --tail 30 "$name" >&2; fail "$name not healthy after $timeout s ($status)"; }
    sleep 0.5
  done
  seconds_since "$start"
}

image_smoke() {
  local name port http metrics started healthy stop_start stopped drain exit_code line
  name=posenc-smoke-$$
  port=$(free_port)
  http=$(free_port)
  metrics=$(free_port)
  step "run: $name on the host network, gRPC 127.0.0.1:$port, HTTP API 127.0.0.1:$http, /metrics 127.0.0.1:$metrics"
  started=$(now)
  "$DOCKER" run -d --name "$name" --network host -e POSENC_HOST=127.0.0.1 -e POSENC_METRICS_HOST=127.0.0.1 \
    -e "POSENC_PORT=$port" -e "POSENC_HTTP_PORT=$http" -e "POSENC_METRICS_PORT=$metrics" \
    -e POSENC_MAX_NEW_TOKENS_LIMIT=2048 "$IMAGE" > /dev/null
  CLEANUP+=("$DOCKER rm -f $name")
  step "health: waiting for the image's own HEALTHCHECK (python -m service.healthcheck, every 10 s)"
  healthy=$(wait_healthy "$started" "$name" 300)
  ok "healthy $healthy s after start"

  step "gRPC: Generate and GenerateStream through 127.0.0.1:$port"
  rpc generate "127.0.0.1:$port" | sed 's/^/[smoke]   /' || fail "Generate / GenerateStream"
  ok "both answered"

  http_api "http://127.0.0.1:$http"

  step "metrics: http://127.0.0.1:$metrics/metrics"
  line=$(curl -fsS --max-time 10 "http://127.0.0.1:$metrics/metrics" | grep -E '^posenc_requests_total\{.*method="Generate"' | head -n 1) \
    || fail "/metrics has no posenc_requests_total for Generate"
  ok "$line"

  step "locust: $LOCUST_IMAGE, 2 users for 8 s against 127.0.0.1:$port"
  "$DOCKER" run --rm --network host "$LOCUST_IMAGE" locust -f loadtest/locustfile.py --headless -u 2 -r 2 -t 8s \
    --host "127.0.0.1:$port" --models alibi --max-new-tokens 16 --only-summary > "$WORK/locust.out" 2>&1 \
    || { tail -n 30 "$WORK/locust.out" >&2; fail "locust reported failures"; }
  line=$(grep -E '^ *Aggregated' "$WORK/locust.out" | head -n 1 | tr -s ' ')
  ok "${line# } (requests, failures, ...)"

  # Streams long enough (a few seconds here) to be running when SIGTERM arrives: 1024 tokens
  # once ended before it did.
  step "drain: docker stop while 4 streams of 2048 tokens run (grace $GRACE s)"
  rpc streams "127.0.0.1:$port" --streams 4 --max-new-tokens 2048 > "$WORK/stream.out" 2>&1 &
  local client=$!
  for _ in $(seq 600); do grep -q "streaming" "$WORK/stream.out" && break; sleep 0.1; done
  grep -q "streaming" "$WORK/stream.out" || fail "the streams never started: $(cat "$WORK/stream.out")"
  stop_start=$(now)
  "$DOCKER" stop -t $((GRACE + 5)) "$name" > /dev/null
  stopped=$(seconds_since "$stop_start")
  wait "$client" || fail "the in-flight streams did not all finish: $(tail -n 2 "$WORK/stream.out")"
  ok "$(tail -n 1 "$WORK/stream.out")"
  drain=$("$DOCKER" logs "$name" 2>&1 | grep -o 'stopped after .*' | tail -n 1) || fail "no 'stopped after' line in the log"
  [[ $drain =~ :\ ([1-9][0-9]*)\ in-flight\ request\(s\)\ finished,\ 0\ cut ]] \
    || fail "the drain finished no stream, or cut some (the streams ended before docker stop?): $drain"
  exit_code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$name")
  [ "$exit_code" = 0 ] || fail "exit code $exit_code"
  python3 -c 'import sys; sys.exit(float(sys.argv[1]) >= float(sys.argv[2]))' "$stopped" "$GRACE" || fail "stop took $stopped s, grace $GRACE s"
  ok "log: $drain; exit code 0; docker stop took $stopped s"
  "$DOCKER" rm "$name" > /dev/null

  step "PASS in $(( $(date +%s) - STARTED )) s"
  echo "image $IMAGE: $SIZE; healthy after $healthy s; stopped after $stopped s"
}

# ---- the compose stack on the host network ---------------------------------------------------------
targets_health() {  # URL of /api/v1/targets: "instance=health ..." of the active targets, sorted
  curl -fsS --max-time 5 "$1" 2> /dev/null | python3 -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
print(" ".join(sorted(t["labels"]["instance"] + "=" + t["health"] for t in targets)))' 2> /dev/null || true
}

compose_smoke() {
  local compose project=posenc-smoke prometheus_port started t n up
  if [ -n "${COMPOSE:-}" ]; then read -ra compose <<< "$COMPOSE"
  elif command -v docker-compose > /dev/null; then compose=(docker-compose)
  else compose=("$DOCKER" compose); fi
  proxy_base=$(base_image "$NGINX_IMAGE" nginx)
  prometheus_base=$(base_image "$PROMETHEUS_IMAGE" prometheus)
  for port in 50051 50061 50062 8000 8001 8002 9465 9466; do
    port_free "$port" || fail "port $port is taken on 127.0.0.1; deploy/compose.host.yml needs it"
  done
  prometheus_port=$(free_port)
  unset COMPOSE_PROFILES
  export POSENC_CPU_IMAGE=$IMAGE POSENC_PROXY_IMAGE=$proxy_base \
    POSENC_PROMETHEUS_IMAGE=$prometheus_base PROMETHEUS_PORT=$prometheus_port
  local dc=("${compose[@]}" -p "$project" -f deploy/compose.host.yml)
  step "compose: ${dc[*]} up -d"
  CLEANUP+=("${dc[*]} down -v --remove-orphans")
  started=$(now)
  logged "${dc[@]}" up -d --no-build || fail "compose up"
  ok "$("${dc[@]}" ps --services --filter status=running | sort | tr '\n' ' ')up; networks of $project: $("$DOCKER" network ls -q --filter "label=com.docker.compose.project=$project" | wc -l) (host network only)"
  for service in replica-1 replica-2; do
    healthy=$(wait_healthy "$started" "$("${dc[@]}" ps -q "$service")" 300)
    ok "$service healthy $healthy s after up"
  done

  step "proxy: 40 calls (20 Generate, 20 GenerateStream) through 127.0.0.1:50051"
  rpc generate 127.0.0.1:50051 --calls 20 | sed 's/^/[smoke]   /' || fail "calls through the proxy"
  http_api http://127.0.0.1:8000
  for metrics in 9465 9466; do
    n=$(curl -fsS --max-time 10 "http://127.0.0.1:$metrics/metrics" \
      | awk '/^posenc_requests_total\{/ && /code="OK"/ {s += $NF} END {print s + 0}')
    [ "${n%.*}" -gt 0 ] || fail "the replica with /metrics on $metrics served none of them"
    ok "replica /metrics 127.0.0.1:$metrics: posenc_requests_total = $n"
  done

  step "prometheus: http://127.0.0.1:$prometheus_port/api/v1/targets"
  t=$(date +%s)
  while true; do
    up=$(targets_health "http://127.0.0.1:$prometheus_port/api/v1/targets")
    [ "$up" = "127.0.0.1:9465=up 127.0.0.1:9466=up" ] && break
    (( $(date +%s) - t < 60 )) || fail "targets: '$up'"
    sleep 1
  done
  ok "$up"

  step "stop: ${compose[*]} -p $project ... stop, then down -v"
  t=$(now)
  logged "${dc[@]}" stop || fail "compose stop"
  local down_seconds left container exits=""
  down_seconds=$(seconds_since "$t")
  for container in $("$DOCKER" ps -aq --filter "label=com.docker.compose.project=$project"); do
    exits+=" $("$DOCKER" inspect -f '{{index .Config.Labels "com.docker.compose.service"}}={{.State.ExitCode}}' "$container")"
  done
  [[ ! $exits =~ =[1-9] ]] || fail "a container did not exit cleanly (137: killed after its grace period):$exits"
  for service in replica-1 replica-2; do
    "${dc[@]}" logs "$service" 2>&1 | grep -q "stopped after" || fail "$service: no 'stopped after' line in its log"
  done
  ok "stopped in $down_seconds s, exit codes:$exits; both replicas logged 'stopped after'"
  logged "${dc[@]}" down -v --remove-orphans || fail "compose down"
  left=$("$DOCKER" ps -aq --filter "label=com.docker.compose.project=$project")
  [ -z "$left" ] || fail "containers left: $left"
  left=$("$DOCKER" network ls -q --filter "label=com.docker.compose.project=$project")
  [ -z "$left" ] || fail "networks left: $left"
  left=$("$DOCKER" volume ls -q --filter "label=com.docker.compose.project=$project")
  [ -z "$left" ] || fail "volumes left: $left"
  ok "no container, network or volume of $project left"
  step "PASS in $(( $(date +%s) - STARTED )) s"
  echo "compose (host network): 2 replicas of $IMAGE ($SIZE), proxy $proxy_base, prometheus $prometheus_base; stopped in $down_seconds s"
}

main() {
  check_engine
  build
  if [ "$MODE" = image ]; then build_locust; image_smoke; else compose_smoke; fi
}

main; exit  # one line: bash has read the whole file before anything runs, and reads no further
