#!/usr/bin/env bash
# Smoke test of the built image (docker/build-images.sh first):
#   1. the runtime dependencies and zmq_omni import, `zmq-omni --help` runs;
#   2. two containers on a user-defined bridge network exchange 100 numpy
#      arrays over TCP with pyzmq PUSH/PULL, addressed by container name (the
#      path the docker-compose deployment uses);
#   3. `docker stop` delivers SIGTERM through tini to the Python process,
#      which exits 0 well before the kill timeout.
# Everything it creates (network, containers) is removed on exit.
set -euo pipefail

IMAGE="${ZMQ_OMNI_IMAGE:-zmq-omni:local}"
NAME="zo-smoke-$$"
NET="$NAME-net"

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'smoke-test: FAILED: %s\n' "$*" >&2; exit 1; }
cleanup() {
    docker rm -f "$NAME-pull" "$NAME-push" "$NAME-term" >/dev/null 2>&1 || true
    docker network rm "$NET" >/dev/null 2>&1 || true
}
trap cleanup EXIT

docker image inspect "$IMAGE" >/dev/null 2>&1 || die "image $IMAGE not found: run docker/build-images.sh"

log "imports in $IMAGE"
docker run --rm "$IMAGE" python -c \
    "import zmq, msgpack, numpy, tenacity, yaml, zmq_omni; print('   python deps + zmq_omni import ok')" \
    || die "imports"
docker run --rm "$IMAGE" zmq-omni --help >/dev/null || die "zmq-omni --help"

log "PUSH/PULL over TCP between two containers on network $NET"
docker network create "$NET" >/dev/null
docker run -d --name "$NAME-pull" --network "$NET" "$IMAGE" python -c '
import msgpack, numpy as np, zmq
s = zmq.Context().socket(zmq.PULL)
s.bind("tcp://0.0.0.0:5555")
total = 0
for _ in range(100):
    hdr, buf = s.recv_multipart(copy=False)
    meta = msgpack.unpackb(hdr.bytes)
    total += int(np.frombuffer(buf.buffer, dtype=meta["dtype"]).reshape(meta["shape"]).sum())
print(total, flush=True)
' >/dev/null
expected="$(docker run --rm --name "$NAME-push" --network "$NET" "$IMAGE" python -c "
import msgpack, numpy as np, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.connect('tcp://$NAME-pull:5555')
total = 0
for i in range(100):
    a = np.full((256, 1024), i, dtype=np.int32)  # 1 MiB
    total += int(a.sum())
    s.send_multipart([msgpack.packb({'dtype': 'int32', 'shape': a.shape}), a])
s.close(linger=20000)
ctx.term()
print(total)
")" || die "pusher"
status="$(timeout 60 docker wait "$NAME-pull")" || die "puller did not finish"
got="$(docker logs "$NAME-pull" 2>&1 | tail -n 1)"
[[ "$status" == 0 && "$got" == "$expected" ]] \
    || die "puller exit $status, checksum '$got' != '$expected'"
log "   100 x 1 MiB arrays received, checksum $got"

log "SIGTERM through tini"
docker run -d --name "$NAME-term" "$IMAGE" python -c '
import signal, sys, time
def stop(signum, frame):
    print("SIGTERM received", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
' >/dev/null
for _ in $(seq 50); do
    [[ "$(docker logs "$NAME-term" 2>&1)" == *ready* ]] && break
    sleep 0.2
done
start=$(date +%s)
docker stop -t 20 "$NAME-term" >/dev/null
took=$(( $(date +%s) - start ))
code="$(docker inspect -f '{{.State.ExitCode}}' "$NAME-term")"
if [[ "$(docker logs "$NAME-term" 2>&1)" != *"SIGTERM received"* || "$code" != 0 || $took -ge 15 ]]; then
    die "stop took ${took}s, exit code $code (SIGTERM not delivered?)"
fi
log "   stopped in ${took}s with exit code 0"
echo "smoke-test: ok (imports, TCP between containers, SIGTERM)"
