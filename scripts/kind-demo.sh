#!/usr/bin/env bash
# End-to-end demo on a local kind cluster: Istio's control plane (istiod, ambient profile)
# and istio-cni, with ztunnel-rs's ztunnel in place of Istio's and a ztunnel-rs waypoint.
#
#   bash scripts/kind-demo.sh            # create the cluster and run every step
#   bash scripts/kind-demo.sh --delete   # delete the cluster
#
# Needs Docker (a running engine) and network access. kind, kubectl and helm are used from
# PATH, or downloaded (pinned versions, official release URLs below) into
# ${XDG_CACHE_HOME:-~/.cache}/ztunnel-rs-demo/bin. Steps and what they show: docs/kubernetes.md.
#
# Settings (environment):
#   CLUSTER_NAME         kind cluster name                  (ztunnel-demo)
#   ISTIO_VERSION        Istio Helm charts                  (1.30.3)
#   GATEWAY_API_VERSION  Gateway API CRDs, standard channel (v1.2.1)
#   KIND_NODE_IMAGE      node image                         (kindest/node:v1.31.2)
#   REGISTRY, TAG        our images REGISTRY/{ztunnel,waypoint}:TAG (ztunnel-rs.local, dev)
#   SKIP_BUILD=1         do not build the images (they must exist locally already)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

CLUSTER_NAME=${CLUSTER_NAME:-ztunnel-demo}
ISTIO_VERSION=${ISTIO_VERSION:-1.30.3}
ISTIO_REPO=${ISTIO_REPO:-https://istio-release.storage.googleapis.com/charts}
GATEWAY_API_VERSION=${GATEWAY_API_VERSION:-v1.2.1}
KIND_NODE_IMAGE=${KIND_NODE_IMAGE:-kindest/node:v1.31.2}
REGISTRY=${REGISTRY:-ztunnel-rs.local}
TAG=${TAG:-dev}
SKIP_BUILD=${SKIP_BUILD:-0}
# Downloaded only when missing from PATH.
KIND_VERSION=v0.25.0
KUBECTL_VERSION=v1.31.2
HELM_VERSION=v3.16.3

NS=ambient-demo              # demo/kind/l4-policy.yaml names identities in this namespace
ISTIO_NS=istio-system
TOOLS_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/ztunnel-rs-demo/bin
STEPS=12
step_no=0

usage() {
  sed -n '2,/^set -euo/p' "$ROOT/scripts/kind-demo.sh" | sed '$d; s/^# \{0,1\}//'
}

step() {
  step_no=$((step_no + 1))
  printf '\n\033[1m==> [%d/%d] %s\033[0m\n' "$step_no" "$STEPS" "$*"
}
info() { printf '    %s\n' "$*"; }
ok() { printf '    \033[32mOK\033[0m %s\n' "$*"; }
die() { printf '\033[31mkind-demo: %s\033[0m\n' "$*" >&2; exit 1; }
# Print a command, then run it.
run() {
  printf '    $ %s\n' "$*"
  "$@"
}

# --- tools -------------------------------------------------------------------------

arch() {
  case "$(uname -m)" in
    x86_64|amd64) echo amd64 ;;
    aarch64|arm64) echo arm64 ;;
    *) die "unsupported machine $(uname -m): install kind, kubectl and helm yourself" ;;
  esac
}

download() { # url dest checksum-url
  info "downloading $1"
  curl -fsSL --retry 3 -o "$2.part" "$1" || die "download failed: $1"
  # Each project publishes a SHA-256 next to its release artifact: a truncated or
  # tampered download is refused rather than run.
  local want got
  want=$(curl -fsSL --retry 3 "$3" | awk '{print $1; exit}') || die "checksum download failed: $3"
  [ "${#want}" = 64 ] || die "no SHA-256 in $3"
  got=$(sha256sum "$2.part" | awk '{print $1}')
  [ "$want" = "$got" ] || { rm -f "$2.part"; die "SHA-256 mismatch for $1: expected $want, got $got"; }
  mv "$2.part" "$2"
}

ensure_tools() {
  command -v docker >/dev/null || die "docker not found: the demo needs a container engine for kind"
  docker info >/dev/null 2>&1 || die "docker cannot reach its engine (is the daemon running, may this user use it?)"
  command -v curl >/dev/null || die "curl not found"
  mkdir -p "$TOOLS_DIR"
  export PATH="$PATH:$TOOLS_DIR"
  local a os
  a=$(arch)
  os=$(uname -s | tr '[:upper:]' '[:lower:]')
  if ! command -v kind >/dev/null; then
    download "https://kind.sigs.k8s.io/dl/${KIND_VERSION}/kind-${os}-${a}" "$TOOLS_DIR/kind" \
      "https://github.com/kubernetes-sigs/kind/releases/download/${KIND_VERSION}/kind-${os}-${a}.sha256sum"
    chmod +x "$TOOLS_DIR/kind"
  fi
  if ! command -v kubectl >/dev/null; then
    download "https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/${os}/${a}/kubectl" "$TOOLS_DIR/kubectl" \
      "https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/${os}/${a}/kubectl.sha256"
    chmod +x "$TOOLS_DIR/kubectl"
  fi
  if ! command -v helm >/dev/null; then
    local tmp
    tmp=$(mktemp -d)
    download "https://get.helm.sh/helm-${HELM_VERSION}-${os}-${a}.tar.gz" "$tmp/helm.tgz" \
      "https://get.helm.sh/helm-${HELM_VERSION}-${os}-${a}.tar.gz.sha256sum"
    tar -xzf "$tmp/helm.tgz" -C "$tmp"
    mv "$tmp/${os}-${a}/helm" "$TOOLS_DIR/helm"
    rm -rf "$tmp"
  fi
  info "kind:    $(command -v kind) ($(kind version 2>/dev/null | awk '{print $2}'))"
  info "kubectl: $(command -v kubectl)"
  info "helm:    $(command -v helm) ($(helm version --short 2>/dev/null))"
}

# --- helpers -----------------------------------------------------------------------

k() { kubectl --context "kind-${CLUSTER_NAME}" "$@"; }
# (Captured first: with pipefail, `kind get clusters | grep -q` can fail on SIGPIPE.)
cluster_exists() {
  local clusters
  clusters=$(kind get clusters 2>/dev/null || true)
  grep -qx "$CLUSTER_NAME" <<<"$clusters"
}

# Run a command in a demo pod; prints what it runs.
exec_in() { # deployment cmd...
  local deploy=$1
  shift
  printf '    $ kubectl -n %s exec deploy/%s -- %s\n' "$NS" "$deploy" "$*"
  k -n "$NS" exec "deploy/$deploy" -c curl -- "$@"
}

# HTTP status code of a request from a demo pod: "000" when the connection failed,
# "exec-failed" when kubectl could not run curl in the pod at all.
http_code() { # deployment url [curl args...]
  local deploy=$1 url=$2 out
  shift 2
  out=$(k -n "$NS" exec "deploy/$deploy" -c curl -- \
    curl -sS -o /dev/null -w '%{http_code}' --max-time 5 "$@" "$url" 2>/dev/null) || true
  echo "${out:-exec-failed}"
}

# Retry until `http_code` gives the expected status (config takes a moment to reach the
# proxies). Prints the request and the result; fails the demo after ~60 s.
expect_code() { # expected deployment url [curl args...]
  local want=$1 deploy=$2 url=$3
  shift 3
  local got="" i
  printf '    $ kubectl -n %s exec deploy/%s -- curl -s -o /dev/null -w %%{http_code} %s %s\n' \
    "$NS" "$deploy" "$*" "$url"
  for i in $(seq 1 30); do
    got=$(http_code "$deploy" "$url" "$@")
    [ "$got" = "$want" ] && break
    sleep 2
  done
  if [ "$got" != "$want" ]; then
    die "expected HTTP ${want} from ${deploy} -> ${url}, got ${got} (after ${i} tries)"
  fi
  if [ "$want" = 000 ]; then
    ok "${deploy} -> ${url}: connection refused/reset (no HTTP response), as expected"
  else
    ok "${deploy} -> ${url}: HTTP ${got}"
  fi
}

ztunnel_logs() { k -n "$ISTIO_NS" logs -l app=ztunnel --tail=500 --prefix 2>/dev/null || true; }

# --- the demo ----------------------------------------------------------------------

create_cluster() {
  step "kind cluster '${CLUSTER_NAME}' (1 control plane + 2 workers, ${KIND_NODE_IMAGE})"
  if cluster_exists; then
    info "cluster exists, reusing it"
  else
    run kind create cluster --name "$CLUSTER_NAME" --image "$KIND_NODE_IMAGE" \
      --config "$ROOT/demo/kind/kind-config.yaml" --wait 120s
  fi
  run kubectl --context "kind-${CLUSTER_NAME}" get nodes -L ztunnel-rs.io/demo-role
}

build_images() {
  step "build our images and load them into the kind nodes"
  if [ "$SKIP_BUILD" = 1 ]; then
    info "SKIP_BUILD=1: using existing ${REGISTRY}/ztunnel:${TAG} and ${REGISTRY}/waypoint:${TAG}"
    run kind load docker-image "${REGISTRY}/ztunnel:${TAG}" "${REGISTRY}/waypoint:${TAG}" --name "$CLUSTER_NAME"
  else
    run bash "$ROOT/scripts/build-images.sh" --registry "$REGISTRY" --tag "$TAG" --kind-load "$CLUSTER_NAME"
  fi
}

install_istio() {
  step "Gateway API CRDs ${GATEWAY_API_VERSION} (github.com/kubernetes-sigs/gateway-api releases)"
  if k get crd gateways.gateway.networking.k8s.io >/dev/null 2>&1; then
    info "already installed"
  else
    run kubectl --context "kind-${CLUSTER_NAME}" apply -f \
      "https://github.com/kubernetes-sigs/gateway-api/releases/download/${GATEWAY_API_VERSION}/standard-install.yaml"
  fi

  step "Istio ${ISTIO_VERSION} base + istiod (ambient profile) + istio-cni, Helm charts from ${ISTIO_REPO}"
  info "Istio's own ztunnel chart is NOT installed: ours takes its place in the next step."
  run helm --kube-context "kind-${CLUSTER_NAME}" upgrade --install istio-base base \
    --repo "$ISTIO_REPO" --version "$ISTIO_VERSION" -n "$ISTIO_NS" --create-namespace --wait
  run helm --kube-context "kind-${CLUSTER_NAME}" upgrade --install istiod istiod \
    --repo "$ISTIO_REPO" --version "$ISTIO_VERSION" -n "$ISTIO_NS" \
    --set profile=ambient --wait --timeout 5m
  # istio-cni's ambient DNS capture (Istio's default) redirects the pods' DNS to ztunnel's
  # DNS proxy on 15053, which ours serves.
  run helm --kube-context "kind-${CLUSTER_NAME}" upgrade --install istio-cni cni \
    --repo "$ISTIO_REPO" --version "$ISTIO_VERSION" -n "$ISTIO_NS" \
    --set profile=ambient --wait --timeout 5m
}

install_ztunnel() {
  step "our ztunnel: charts/ztunnel as DaemonSet ${ISTIO_NS}/ztunnel (captureMode=none)"
  # captureMode=none: istio-cni already programs each pod's redirection. (eBPF capture
  # cannot work in kind anyway: a kind node's /sys/fs/cgroup is not the host's cgroup root.)
  run helm --kube-context "kind-${CLUSTER_NAME}" upgrade --install ztunnel "$ROOT/charts/ztunnel" \
    -n "$ISTIO_NS" --set image.repository="${REGISTRY}/ztunnel" --set image.tag="$TAG" \
    --set captureMode=none --wait --timeout 5m
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$ISTIO_NS" rollout status ds/ztunnel --timeout 120s
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$ISTIO_NS" get pods -o wide
}

deploy_apps() {
  step "namespace ${NS} enrolled in the mesh (istio.io/dataplane-mode=ambient) and the demo apps"
  k create namespace "$NS" --dry-run=client -o yaml | k apply -f - >/dev/null
  run kubectl --context "kind-${CLUSTER_NAME}" label namespace "$NS" istio.io/dataplane-mode=ambient --overwrite
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$NS" apply -f "$ROOT/demo/kind/apps.yaml"
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$NS" wait --for=condition=Available deploy --all --timeout 300s
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$NS" get pods -o wide
  # istio-cni annotates a pod it has handed to ztunnel and set up redirection for.
  local pod state
  for pod in $(k -n "$NS" get pods -o name); do
    state=$(k -n "$NS" get "$pod" -o jsonpath='{.metadata.annotations.ambient\.istio\.io/redirection}')
    [ "$state" = enabled ] || die "$pod is not enrolled (ambient.istio.io/redirection='${state}'): see 'kubectl -n ${ISTIO_NS} logs ds/istio-cni-node' and ds/ztunnel"
  done
  ok "every pod in ${NS} is enrolled (annotation ambient.istio.io/redirection=enabled)"
}

show_mtls() {
  step "mTLS: curl -> httpbin crosses nodes inside HBONE; the ztunnels log both identities"
  expect_code 200 curl http://httpbin:8000/get
  exec_in curl curl -sS --max-time 5 http://httpbin:8000/headers
  info "ztunnel access log lines (src.identity / dst.identity come from verified certificates):"
  ztunnel_logs | grep -E 'httpbin' | grep -E 'identity' | tail -n 4 | sed 's/^/      /' || true
  if ! ztunnel_logs | grep -q 'spiffe://cluster.local/ns/ambient-demo/sa/curl'; then
    die "no ztunnel log line names spiffe://cluster.local/ns/ambient-demo/sa/curl"
  fi
  ok "ztunnel logs show spiffe://cluster.local/ns/ambient-demo/sa/curl"
  local node zpod=""
  node=$(k get nodes -l ztunnel-rs.io/demo-role=server -o jsonpath='{.items[0].metadata.name}')
  [ -z "$node" ] || zpod=$(k -n "$ISTIO_NS" get pods -l app=ztunnel \
    --field-selector "spec.nodeName=${node}" -o jsonpath='{.items[0].metadata.name}')
  if [ -n "$zpod" ]; then
    info "metrics of ${zpod} (the server node's ztunnel), via the API server's pod proxy:"
    printf '    $ kubectl get --raw /api/v1/namespaces/%s/pods/%s:15020/proxy/stats/prometheus | grep ...\n' "$ISTIO_NS" "$zpod"
    k get --raw "/api/v1/namespaces/${ISTIO_NS}/pods/${zpod}:15020/proxy/stats/prometheus" 2>/dev/null \
      | grep '^istio_tcp_connections_opened_total' | grep 'destination_workload="httpbin"' \
      | head -n 2 | sed 's/^/      /' || true
  fi
}

l4_policy() {
  step "L4 AuthorizationPolicy: only .../sa/curl may connect to httpbin (enforced by ztunnel)"
  info "before the policy, intruder gets through too:"
  expect_code 200 intruder http://httpbin:8000/get
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$NS" apply -f "$ROOT/demo/kind/l4-policy.yaml"
  expect_code 000 intruder http://httpbin:8000/get
  expect_code 200 curl http://httpbin:8000/get
  info "ztunnel's log of the denial:"
  ztunnel_logs | grep -E 'sa/intruder' | grep -iE 'deny|denied|unauthori|policy|rbac' | tail -n 2 | sed 's/^/      /' || true
}

install_waypoint() {
  step "our waypoint: charts/waypoint in ${NS} (Gateway 'waypoint', class istio-waypoint)"
  run helm --kube-context "kind-${CLUSTER_NAME}" upgrade --install waypoint "$ROOT/charts/waypoint" \
    -n "$NS" --set image.repository="${REGISTRY}/waypoint" --set image.tag="$TAG" --wait --timeout 5m
  if ! k -n "$NS" wait --for=condition=Programmed gateway/waypoint --timeout 120s >/dev/null; then
    k -n "$NS" get gateway waypoint -o yaml || true
    die "istiod did not mark Gateway ${NS}/waypoint Programmed"
  fi
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$NS" get gateway,deploy,svc -l app.kubernetes.io/name=waypoint
  ok "Gateway waypoint is Programmed (istiod resolved it to Service waypoint.${NS}; it deployed nothing of its own)"
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$NS" label service helloworld istio.io/use-waypoint=waypoint --overwrite
}

l7() {
  step "HTTPRoute (x-version header -> helloworld-v1 / -v2) and L7 AuthorizationPolicy (deny /admin)"
  run kubectl --context "kind-${CLUSTER_NAME}" -n "$NS" apply -f "$ROOT/demo/kind/l7.yaml"
  # Wait until the route is in force: a v2 answer for the header.
  local i body=""
  for i in $(seq 1 30); do
    body=$(k -n "$NS" exec deploy/curl -c curl -- curl -sS --max-time 5 -H 'x-version: v2' http://helloworld:5000/hello 2>/dev/null || true)
    case "$body" in *"version: v2"*) break ;; esac
    sleep 2
  done
  case "$body" in *"version: v2"*) ;; *) die "the HTTPRoute did not take effect after ${i} tries (last answer: '${body}')" ;; esac

  step "L7 routing and a 403, through the waypoint"
  local v1=0 v2=0
  printf '    $ kubectl -n %s exec deploy/curl -- curl -s http://helloworld:5000/hello   (x10)\n' "$NS"
  for _ in $(seq 1 10); do
    body=$(k -n "$NS" exec deploy/curl -c curl -- curl -sS --max-time 5 http://helloworld:5000/hello 2>&1 || true)
    case "$body" in *"version: v1"*) v1=$((v1 + 1)) ;; *"version: v2"*) v2=$((v2 + 1)) ;; esac
  done
  info "without header: v1=${v1} v2=${v2}"
  [ "$v1" = 10 ] || die "expected all 10 requests without x-version to reach helloworld-v1"
  ok "no header -> helloworld-v1 (10/10)"
  v1=0 v2=0
  printf "    \$ kubectl -n %s exec deploy/curl -- curl -s -H 'x-version: v2' http://helloworld:5000/hello   (x10)\n" "$NS"
  for _ in $(seq 1 10); do
    body=$(k -n "$NS" exec deploy/curl -c curl -- curl -sS --max-time 5 -H 'x-version: v2' http://helloworld:5000/hello 2>&1 || true)
    case "$body" in *"version: v1"*) v1=$((v1 + 1)) ;; *"version: v2"*) v2=$((v2 + 1)) ;; esac
  done
  info "with x-version: v2: v1=${v1} v2=${v2}"
  [ "$v2" = 10 ] || die "expected all 10 requests with x-version: v2 to reach helloworld-v2"
  ok "x-version: v2 -> helloworld-v2 (10/10)"
  exec_in curl curl -sS --max-time 5 -H 'x-version: v2' http://helloworld:5000/hello
  expect_code 403 curl http://helloworld:5000/admin
  expect_code 403 curl http://helloworld:5000/admin/keys
  exec_in curl curl -sS --max-time 5 http://helloworld:5000/admin/keys || true
  echo
  info "waypoint access log (the last requests):"
  k -n "$NS" logs deploy/waypoint --tail=200 2>/dev/null | grep -E 'request complete' | tail -n 3 | sed 's/^/      /' || true
}

summary() {
  step "done"
  cat <<EOF
    The cluster stays up for exploring, e.g.:
      kubectl --context kind-${CLUSTER_NAME} -n ${ISTIO_NS} logs ds/ztunnel -f
      kubectl --context kind-${CLUSTER_NAME} -n ${NS} logs deploy/waypoint -f
      kubectl --context kind-${CLUSTER_NAME} -n ${NS} exec deploy/curl -- curl -s http://httpbin:8000/get
    Delete it with:
      bash scripts/kind-demo.sh --delete
EOF
}

delete_cluster() {
  command -v kind >/dev/null || export PATH="$PATH:$TOOLS_DIR"
  command -v kind >/dev/null || die "kind not found (nothing to delete?)"
  if cluster_exists; then
    run kind delete cluster --name "$CLUSTER_NAME"
  else
    info "no kind cluster named ${CLUSTER_NAME}"
  fi
}

main() {
  case "${1:-}" in
    "") ;;
    --delete) delete_cluster; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
  echo "ztunnel-rs kind demo: cluster ${CLUSTER_NAME}, Istio ${ISTIO_VERSION}, images ${REGISTRY}/{ztunnel,waypoint}:${TAG}"
  ensure_tools
  create_cluster
  build_images
  install_istio
  install_ztunnel
  deploy_apps
  show_mtls
  l4_policy
  install_waypoint
  l7
  summary
}

main "$@"
