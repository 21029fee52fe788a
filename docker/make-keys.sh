#!/usr/bin/env bash
# Make the CURVE keys of deploy/pipeline.yaml for docker-compose.yml: the setup
# step of docs/security.md (docker/build-images.sh runs it with --if-missing).
#
#   docker/make-keys.sh                  keys for every party, unless they all exist
#   docker/make-keys.sh --rotate talker  a new pair for one party (then restart the stages)
#   docker/make-keys.sh --force          new keys for every party
#
# Runs `zmq-omni keygen --config` inside the image, so the host needs no
# Python. Writes deploy/keys/<party>.keys (0600: the party's secret key and the
# public keys it needs) and <party>.pub, in a 0700 directory owned by the
# image's zmq user, which the containers run as; docker-compose.yml mounts each
# container's files read-only at /keys. The container has no network.
#
# Environment: ZMQ_OMNI_IMAGE (default zmq-omni:local), ZMQ_OMNI_KEYS_HOST_DIR
# (default deploy/keys beside this repository's deploy/pipeline.yaml).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "${SCRIPT_DIR}/.." && pwd)"
IMAGE="${ZMQ_OMNI_IMAGE:-zmq-omni:local}"
KEYS_DIR="${ZMQ_OMNI_KEYS_HOST_DIR:-$REPO_DIR/deploy/keys}"

case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[[ $# -gt 0 ]] || set -- --if-missing
docker image inspect "$IMAGE" >/dev/null 2>&1 \
    || { echo "make-keys: image $IMAGE not found: run docker/build-images.sh" >&2; exit 1; }
mkdir -p "$KEYS_DIR"
KEYS_DIR="$(cd "$KEYS_DIR" && pwd)"
# As root in the container (it may write the host directory), then hand the files to the zmq user.
docker run --rm --user 0 --network none \
    -v "$REPO_DIR/deploy/pipeline.yaml:/cfg/pipeline.yaml:ro" -v "$KEYS_DIR:/keys" \
    "$IMAGE" sh -c 'zmq-omni keygen --config /cfg/pipeline.yaml --out-dir /keys "$@" \
                    && chown -R zmq:zmq /keys && chmod 700 /keys' keygen "$@"
