#!/usr/bin/env bash
# Builds the ztunnel and waypoint container images (docker/*.Dockerfile) from this
# repository, and optionally pushes them or loads them into a kind cluster.
#
#   bash scripts/build-images.sh                                  # ztunnel-rs.local/{ztunnel,waypoint}:dev
#   bash scripts/build-images.sh --registry ghcr.io/me --tag v0.1.0 --push
#   bash scripts/build-images.sh --kind-load ztunnel-demo         # kind load docker-image ...
#
# Needs Docker with BuildKit (Docker 23+, or DOCKER_BUILDKIT=1) or `docker buildx`.
# DOCKER=podman also works for building and pushing.
set -euo pipefail
cd "$(dirname "$0")/.."

registry=${REGISTRY:-ztunnel-rs.local}
tag=${TAG:-dev}
platform=""
push=false
kind_cluster=""
images=(ztunnel waypoint)
docker=${DOCKER:-docker}

usage() {
  cat <<EOF
usage: $0 [--registry REG] [--tag TAG] [--platform linux/amd64|linux/arm64] [--push]
          [--kind-load CLUSTER] [--only ztunnel|waypoint]
  --registry   image repository prefix (default: \$REGISTRY or ztunnel-rs.local)
  --tag        image tag (default: \$TAG or dev)
  --platform   build for this platform (docker buildx); default: the host's
  --push       push both images after building
  --kind-load  load both images into the nodes of this kind cluster
  --only       build one image only
Images: REG/ztunnel:TAG and REG/waypoint:TAG
EOF
}

die() { echo "build-images: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --registry) [ $# -ge 2 ] || die "--registry needs a value"; registry=$2; shift 2 ;;
    --tag) [ $# -ge 2 ] || die "--tag needs a value"; tag=$2; shift 2 ;;
    --platform) [ $# -ge 2 ] || die "--platform needs a value"; platform=$2; shift 2 ;;
    --push) push=true; shift ;;
    --kind-load) [ $# -ge 2 ] || die "--kind-load needs a cluster name"; kind_cluster=$2; shift 2 ;;
    --only)
      [ $# -ge 2 ] || die "--only needs ztunnel or waypoint"
      case "$2" in ztunnel|waypoint) images=("$2") ;; *) die "--only: unknown image '$2'" ;; esac
      shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

command -v "$docker" >/dev/null || die "'$docker' not found: install Docker (or set DOCKER=podman)"
"$docker" info >/dev/null 2>&1 || die "'$docker' cannot reach a container engine (is the daemon running?)"
if [ -n "$kind_cluster" ]; then
  command -v kind >/dev/null || die "--kind-load needs the 'kind' binary"
fi

# `docker buildx build --load` when buildx is there (needed for --platform), else plain
# `docker build` with BuildKit for the Dockerfiles' cache mounts.
build() {
  local name=$1 ref=$2
  local args=(-f "docker/${name}.Dockerfile" -t "$ref")
  [ -n "$platform" ] && args+=(--platform "$platform")
  if [ "$docker" = docker ] && docker buildx version >/dev/null 2>&1; then
    docker buildx build --load "${args[@]}" .
  else
    [ -z "$platform" ] || [ "$docker" != docker ] || die "--platform needs docker buildx"
    DOCKER_BUILDKIT=1 "$docker" build "${args[@]}" .
  fi
}

refs=()
for name in "${images[@]}"; do
  ref="${registry}/${name}:${tag}"
  echo "==> building ${ref} (docker/${name}.Dockerfile)"
  start=$SECONDS
  build "$name" "$ref"
  echo "    built ${ref} in $((SECONDS - start)) s"
  refs+=("$ref")
done

if $push; then
  for ref in "${refs[@]}"; do
    echo "==> pushing ${ref}"
    "$docker" push "$ref"
  done
fi

if [ -n "$kind_cluster" ]; then
  for ref in "${refs[@]}"; do
    echo "==> loading ${ref} into kind cluster ${kind_cluster}"
    kind load docker-image "$ref" --name "$kind_cluster"
  done
fi

echo "==> done: ${refs[*]}"
