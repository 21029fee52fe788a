#!/usr/bin/env bash
# Build the zmq-omni container images offline.
#
#   zmq-omni-base:bookworm  minimal Debian bookworm (python3.11, venv, tini),
#                           made with debootstrap and loaded with `docker import`
#   zmq-omni:local          the application image (docker/Dockerfile): a venv at
#                           /opt/zmq-omni/venv with zmq-omni[yaml] installed from
#                           wheels prepared on the host
#
# No image registry is needed: Debian packages come from the host's configured
# Debian mirror, Python packages are fetched on the host as manylinux wheels and
# installed inside the image with `pip --no-index`.
#
# It then makes the demo's CURVE keys (docker/make-keys.sh --if-missing: kept
# when they exist) in deploy/keys, which docker-compose.yml mounts read-only.
#
# Usage: docker/build-images.sh [--rebuild-base] [--rebuild-wheels] [--base-only]
#                               [--no-keys] [--repo DIR] [--cache DIR]
# See --help and docs/deployment.md.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "${SCRIPT_DIR}/.." && pwd)"
CACHE_DIR="${ZMQ_OMNI_DOCKER_CACHE:-${HOME:-/root}/.cache/zmq-omni-docker}"
BASE_IMAGE="${ZMQ_OMNI_BASE_IMAGE:-zmq-omni-base:bookworm}"
APP_IMAGE="${ZMQ_OMNI_IMAGE:-zmq-omni:local}"
DEPS_IMAGE="${APP_IMAGE%%:*}-deps:local"
SUITE="bookworm"
# Packages added to debootstrap's minbase. python3 is 3.11 in bookworm, the same
# ABI (cp311) as the wheels fetched below.
BASE_PACKAGES="python3,python3-venv,ca-certificates,tini,iproute2"
# Extra runtime requirements of the image besides the project's own
# dependencies (read from pyproject.toml): the [yaml] extra.
EXTRAS="yaml"
# Wheels are fetched for the interpreter inside the image, whatever the host's is.
WHEEL_PY_VERSION="311"
WHEEL_PLATFORMS=(manylinux_2_36_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64
                 manylinux2014_x86_64 linux_x86_64)

REBUILD_BASE=0
REBUILD_WHEELS=0
BASE_ONLY=0
MAKE_KEYS=1

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    cat <<EOF
Options:
  --rebuild-base     run debootstrap again and re-import ${BASE_IMAGE}
                     (ignores the cached image and root filesystem tarball)
  --rebuild-wheels   fetch the dependency wheels again (ignores the wheel cache)
  --base-only        stop after the base image and the dependency wheels
  --no-keys          do not make the compose demo's CURVE keys (docker/make-keys.sh)
  --repo DIR         repository to build the zmq-omni wheel from (default: ${REPO_DIR})
  --cache DIR        cache directory (default: \${ZMQ_OMNI_DOCKER_CACHE:-\$HOME/.cache/zmq-omni-docker})
  -h, --help         this help

Environment: ZMQ_OMNI_DOCKER_CACHE, ZMQ_OMNI_DEBIAN_MIRROR (default: the host's
apt configuration), ZMQ_OMNI_IMAGE (default zmq-omni:local),
ZMQ_OMNI_BASE_IMAGE (default zmq-omni-base:bookworm), PYTHON (default python3).
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --rebuild-base) REBUILD_BASE=1 ;;
        --rebuild-wheels) REBUILD_WHEELS=1 ;;
        --base-only) BASE_ONLY=1 ;;
        --no-keys) MAKE_KEYS=0 ;;
        --repo) REPO_DIR="$(cd "${2:?--repo needs a directory}" && pwd)"; shift ;;
        --repo=*) REPO_DIR="$(cd "${1#--repo=}" && pwd)" ;;
        --cache) CACHE_DIR="${2:?--cache needs a directory}"; shift ;;
        --cache=*) CACHE_DIR="${1#--cache=}" ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build-images: unknown option: $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done

PYTHON="${PYTHON:-python3}"
T_START=$(date +%s.%N)
declare -a TIMINGS=()

log()  { printf '==> %s\n' "$*" >&2; }
warn() { printf 'build-images: WARNING: %s\n' "$*" >&2; }
die()  { printf 'build-images: ERROR: %s\n' "$*" >&2; exit 1; }
now()  { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
record() { TIMINGS+=("$(printf '%-28s %7ss' "$1" "$2")"); log "$1: $2 s"; }
print_timings() {
    log "timings:"
    local t
    for t in "${TIMINGS[@]}"; do printf '    %s\n' "$t" >&2; done
    printf '    %-28s %7ss\n' "total" "$(since "$T_START")" >&2
}

# --- preflight ---------------------------------------------------------------
command -v docker >/dev/null 2>&1 || die "the docker CLI is not installed"
docker info >/dev/null 2>&1 || die "cannot reach the Docker engine (is dockerd running? are you allowed to use it?)"
# Without the buildx plugin the CLI falls back to the classic builder; say so
# explicitly so a DOCKER_BUILDKIT=1 in the environment does not break the build.
if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=...)"
[[ -f "$REPO_DIR/pyproject.toml" ]] || die "no pyproject.toml in $REPO_DIR (use --repo DIR)"
mkdir -p "$CACHE_DIR"
CACHE_DIR="$(cd "$CACHE_DIR" && pwd)"
# One build at a time per cache (a test and a developer may start it together).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE_DIR/.lock"
    flock -n 9 || { log "another build holds $CACHE_DIR/.lock: waiting"; flock 9; }
fi
log "repository: $REPO_DIR"
log "cache:      $CACHE_DIR"

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }
image_env() {  # image_env IMAGE NAME -> value of ENV NAME in the image config
    docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$1" 2>/dev/null \
        | sed -n "s/^$2=//p"
}

# A key for the base image: changes when the suite or package list changes, so
# an edit of this script rebuilds the base even without --rebuild-base.
BASE_KEY="$(printf '%s|%s|v1' "$SUITE" "$BASE_PACKAGES" | sha256sum | cut -c1-16)"
ROOTFS_TAR="$CACHE_DIR/base/rootfs-${SUITE}-${BASE_KEY}.tar.gz"

detect_mirror() {
    if [[ -n "${ZMQ_OMNI_DEBIAN_MIRROR:-}" ]]; then echo "$ZMQ_OMNI_DEBIAN_MIRROR"; return; fi
    local f uri=""
    # deb822 sources: the URIs of a stanza whose Suites include the suite itself.
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        uri="$(awk -v suite="$SUITE" '
            BEGIN { RS = ""; FS = "\n" }
            {
                u = ""; s = ""
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/)   { u = $i; sub(/^URIs:[ \t]*/, "", u); sub(/[ \t].*/, "", u) }
                    if ($i ~ /^Suites:/) { s = " " $i " " }
                }
                if (u != "" && s ~ (" " suite " ")) { print u; exit }
            }' "$f")"
        [[ -n "$uri" ]] && { echo "$uri"; return; }
    done
    # one-line sources: deb [opts] URI SUITE components
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        uri="$(awk -v suite="$SUITE" '$1 == "deb" {
                  i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                  if ($(i + 1) == suite) { print $i; exit } }' "$f")"
        [[ -n "$uri" ]] && { echo "$uri"; return; }
    done
    echo "http://deb.debian.org/debian"
}

ensure_debootstrap() {
    command -v debootstrap >/dev/null 2>&1 && return
    [[ $(id -u) -eq 0 ]] || die "debootstrap is missing and we are not root: apt-get install debootstrap"
    log "installing debootstrap (apt-get update && apt-get install debootstrap)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; } \
        >"$CACHE_DIR/apt-debootstrap.log" 2>&1 \
        || { cat "$CACHE_DIR/apt-debootstrap.log" >&2; die "could not install debootstrap"; }
}

make_rootfs_tarball() {
    [[ $(id -u) -eq 0 ]] || die "debootstrap needs root (run this script as root, or import a cached $ROOTFS_TAR)"
    ensure_debootstrap
    local mirror keyring_opt=() rootfs t0
    mirror="$(detect_mirror)"
    [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] &&
        keyring_opt=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
    mkdir -p "$CACHE_DIR/base"
    rootfs="$(mktemp -d "$CACHE_DIR/base/rootfs.XXXXXX")"
    # shellcheck disable=SC2064
    trap "umount_below '$rootfs'; rm -rf '$rootfs'" EXIT
    log "debootstrap $SUITE (minbase + $BASE_PACKAGES) from $mirror"
    t0=$(now)
    if ! debootstrap --variant=minbase --components=main --include="$BASE_PACKAGES" \
            "${keyring_opt[@]}" "$SUITE" "$rootfs" "$mirror" >"$CACHE_DIR/base/debootstrap.log" 2>&1; then
        tail -n 30 "$CACHE_DIR/base/debootstrap.log" >&2
        [[ -f "$rootfs/debootstrap/debootstrap.log" ]] && tail -n 30 "$rootfs/debootstrap/debootstrap.log" >&2
        die "debootstrap failed (full log: $CACHE_DIR/base/debootstrap.log)"
    fi
    umount_below "$rootfs"
    record "debootstrap" "$(since "$t0")"

    t0=$(now)
    # Keep the image small: no docs, man pages, locales, apt lists or caches.
    rm -rf "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
           "$rootfs"/usr/share/lintian "$rootfs"/usr/share/linda \
           "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
           "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/debconf/*-old \
           "$rootfs"/var/log/* "$rootfs"/debootstrap
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
    # Docker manages these files per container.
    rm -f "$rootfs"/etc/hostname "$rootfs"/etc/resolv.conf "$rootfs"/etc/machine-id
    : > "$rootfs/etc/machine-id"
    # Keep future image-side installs (if a user adds some) free of docs too.
    cat > "$rootfs/etc/dpkg/dpkg.cfg.d/01-zmq-omni-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
    printf 'zmq-omni-base %s %s\n' "$SUITE" "$BASE_KEY" > "$rootfs/etc/zmq-omni-base"
    [[ -x "$rootfs/usr/bin/python3" ]] || die "python3 missing from the root filesystem"
    [[ -x "$rootfs/usr/bin/tini" ]] || die "tini missing from the root filesystem"
    # /dev, /proc, /sys are provided by the container runtime: ship them empty.
    tar --numeric-owner --xattrs -C "$rootfs" \
        --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
        -cf - . | gzip -1 > "$ROOTFS_TAR.tmp"
    mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
    rm -rf "$rootfs"
    trap - EXIT
    # Drop tarballs of other package lists.
    find "$CACHE_DIR/base" -maxdepth 1 -name "rootfs-*.tar.gz" ! -path "$ROOTFS_TAR" -delete
    record "strip + tar rootfs" "$(since "$t0")"
    log "root filesystem tarball: $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1))"
}

umount_below() {  # unmount anything debootstrap may have left mounted in $1
    local dir="$1" m
    [[ -d "$dir" ]] || return 0
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/mounts | sort -r)
}

OLD_BASE_ID=""
build_base() {
    OLD_BASE_ID="$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || true)"
    if [[ $REBUILD_BASE -eq 0 ]] && image_exists "$BASE_IMAGE"; then
        if [[ "$(image_env "$BASE_IMAGE" ZMQ_OMNI_BASE_KEY)" == "$BASE_KEY" ]]; then
            log "base image $BASE_IMAGE exists: skipping debootstrap (--rebuild-base to force)"
            return
        fi
        log "base image $BASE_IMAGE was made from another package list: rebuilding it"
    fi
    if [[ $REBUILD_BASE -eq 1 || ! -s "$ROOTFS_TAR" ]]; then
        make_rootfs_tarball
    else
        log "using cached root filesystem $ROOTFS_TAR"
    fi
    local t0
    t0=$(now)
    log "docker import -> $BASE_IMAGE"
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change "ENV ZMQ_OMNI_BASE_KEY=$BASE_KEY" \
        --change 'CMD ["/bin/bash"]' \
        --message "zmq-omni base: debootstrap $SUITE minbase + $BASE_PACKAGES" \
        "$ROOTFS_TAR" "$BASE_IMAGE" >/dev/null
    record "docker import" "$(since "$t0")"
}

# --- Python wheels -------------------------------------------------------------
runtime_requirements() {  # the project's runtime deps + the image's extras, from pyproject.toml
    "$PYTHON" - "$REPO_DIR/pyproject.toml" "$EXTRAS" <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11 on the host
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
reqs = list(project.get("dependencies", []))
for extra in filter(None, sys.argv[2].split(",")):
    reqs += project.get("optional-dependencies", {}).get(extra, [])
print("\n".join(sorted(set(reqs))))
EOF
}

prepare_dep_wheels() {
    local reqs key t0 platform_opts=() p
    reqs="$(runtime_requirements)" || die "cannot read the dependencies from $REPO_DIR/pyproject.toml"
    key="$(printf '%s|cp%s|%s' "$reqs" "$WHEEL_PY_VERSION" "${WHEEL_PLATFORMS[*]}" | sha256sum | cut -c1-16)"
    DEPS_WHEELS="$CACHE_DIR/wheels/deps-$key"
    if [[ $REBUILD_WHEELS -eq 0 && -f "$DEPS_WHEELS/.complete" ]]; then
        log "dependency wheels cached: $DEPS_WHEELS (--rebuild-wheels to refresh)"
        return
    fi
    log "fetching dependency wheels for cp$WHEEL_PY_VERSION manylinux: $(echo "$reqs" | tr '\n' ' ')"
    t0=$(now)
    rm -rf "$DEPS_WHEELS"
    mkdir -p "$DEPS_WHEELS.tmp"
    printf '%s\n' "$reqs" > "$DEPS_WHEELS.tmp/requirements.txt"
    for p in "${WHEEL_PLATFORMS[@]}"; do platform_opts+=(--platform "$p"); done
    # --only-binary + --platform/--python-version: wheels for the image's
    # interpreter (CPython 3.11, glibc 2.36), never an sdist built for the host.
    "$PYTHON" -m pip download --quiet --disable-pip-version-check \
        --only-binary=:all: --implementation cp --python-version "$WHEEL_PY_VERSION" \
        --abi "cp$WHEEL_PY_VERSION" --abi abi3 --abi none "${platform_opts[@]}" --platform any \
        --dest "$DEPS_WHEELS.tmp" -r "$DEPS_WHEELS.tmp/requirements.txt" \
        || die "pip download of the dependency wheels failed"
    touch "$DEPS_WHEELS.tmp/.complete"
    mv "$DEPS_WHEELS.tmp" "$DEPS_WHEELS"
    find "$CACHE_DIR/wheels" -mindepth 1 -maxdepth 1 -name 'deps-*' ! -path "$DEPS_WHEELS" -exec rm -rf {} +
    record "dependency wheels" "$(since "$t0")"
}

build_project_wheel() {  # always rebuilt: the project changes every commit
    local out="$1" t0
    t0=$(now)
    log "building the zmq-omni wheel from $REPO_DIR"
    mkdir -p "$out"
    if ! "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps \
            --wheel-dir "$out" "$REPO_DIR" >"$CACHE_DIR/project-wheel.log" 2>&1; then
        # pip's own summary hides the cause: show the build backend's error lines.
        grep -E 'Error|error:' "$CACHE_DIR/project-wheel.log" | grep -v 'subprocess-exited-with-error' | head -n 15 >&2 || true
        return 1
    fi
    record "project wheel" "$(since "$t0")"
}

# --- main --------------------------------------------------------------------
build_base
prepare_dep_wheels

CONTEXT="$(mktemp -d "$CACHE_DIR/context.XXXXXX")"
trap 'rm -rf "$CONTEXT"' EXIT
mkdir -p "$CONTEXT/wheels"
cp "$SCRIPT_DIR/Dockerfile" "$CONTEXT/Dockerfile"
cp -a "$DEPS_WHEELS" "$CONTEXT/wheels/deps"
rm -f "$CONTEXT/wheels/deps/.complete"

if [[ $BASE_ONLY -eq 1 ]]; then
    print_timings
    log "done (--base-only): $BASE_IMAGE, dependency wheels in $DEPS_WHEELS"
    exit 0
fi

PROJECT_OK=1
build_project_wheel "$CONTEXT/wheels/project" || PROJECT_OK=0

# The dependency stage is tagged too: an untagged stage image would be
# "dangling" and lost to the pruning below, and with it the layer cache.
t0=$(now)
log "docker build -> $DEPS_IMAGE (dependency stage; log: $CACHE_DIR/docker-build.log)"
docker build --target deps --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    -t "$DEPS_IMAGE" "$CONTEXT" >"$CACHE_DIR/docker-build.log" 2>&1 \
    || { cat "$CACHE_DIR/docker-build.log" >&2; die "docker build of the dependency stage failed"; }
record "docker build (deps stage)" "$(since "$t0")"

prune_superseded() {
    # Images of this project that lost their tag to a newer build (old app and
    # dependency stages, and through them old base layers). Filtered by the
    # label set in docker/Dockerfile, so other images on the engine are safe.
    docker image prune --force --filter dangling=true --filter label=io.zmq-omni.build=1 >/dev/null 2>&1 || true
    if [[ -n "$OLD_BASE_ID" ]] && [[ "$OLD_BASE_ID" != "$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE" 2>/dev/null)" ]]; then
        docker image rm "$OLD_BASE_ID" >/dev/null 2>&1 || true
    fi
}

if [[ $PROJECT_OK -eq 0 ]]; then
    prune_superseded
    print_timings
    die "the zmq-omni wheel did not build (log: $CACHE_DIR/project-wheel.log): $APP_IMAGE NOT built; the base image, the dependency wheels and $DEPS_IMAGE are ready"
fi

t0=$(now)
log "docker build -> $APP_IMAGE (log: $CACHE_DIR/docker-build.log)"
if ! docker build --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$APP_IMAGE" "$CONTEXT" \
        >>"$CACHE_DIR/docker-build.log" 2>&1; then
    cat "$CACHE_DIR/docker-build.log" >&2
    die "docker build of $APP_IMAGE failed"
fi
record "docker build (app)" "$(since "$t0")"
prune_superseded

# Quick check that the image runs the CLI.
if ! docker run --rm "$APP_IMAGE" zmq-omni --help >/dev/null 2>"$CACHE_DIR/smoke.log"; then
    tail -n 5 "$CACHE_DIR/smoke.log" >&2
    warn "'zmq-omni --help' does not run in $APP_IMAGE yet (zmq_omni.cli missing?)"
fi
if [[ $MAKE_KEYS -eq 1 ]]; then
    t0=$(now)
    ZMQ_OMNI_IMAGE="$APP_IMAGE" "$SCRIPT_DIR/make-keys.sh" --if-missing >&2 \
        || die "docker/make-keys.sh failed: the compose demo has no CURVE keys"
    record "CURVE keys (deploy/keys)" "$(since "$t0")"
fi
print_timings
log "images:"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' \
    | grep -E "^(${BASE_IMAGE}|${DEPS_IMAGE}|${APP_IMAGE})  " | sed 's/^/    /' >&2 || true
log "done: $APP_IMAGE"
