# syntax=docker/dockerfile:1
# ztunnel-rs node proxy image. Build from the repository root (BuildKit is required for the
# cache mounts; Docker 23+ uses it by default):
#
#   docker build -f docker/ztunnel.Dockerfile -t ztunnel-rs.local/ztunnel:dev .
#
# or `bash scripts/build-images.sh`.

ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS builder
# clang/llvm + libbpf-dev (+ the kernel UAPI headers): ebpf/build.rs compiles
# ebpf/bpf/capture.bpf.c with `clang -target bpf`. gcc: crates with C parts (ring). The
# .proto files are compiled in Rust (protox): no protoc needed.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      clang llvm libbpf-dev linux-libc-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The registry and target caches survive between builds; the binary is copied out of the
# cached target dir in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,id=ztunnel-rs-target \
    cargo build --release --locked -p ztunnel \
 && install -D -m 0755 target/release/ztunnel /out/ztunnel

FROM ${RUNTIME_IMAGE}
# iproute2 (`ip`) and nftables (`nft`): ztunnel programs ip rules/routes and, in nftables
# capture mode, nftables tables inside each enrolled pod's network namespace.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      iproute2 nftables ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/ztunnel /usr/local/bin/ztunnel
LABEL org.opencontainers.image.title="ztunnel-rs ztunnel" \
      org.opencontainers.image.description="Ambient mesh node proxy (HBONE, mTLS, L4 authorization)" \
      org.opencontainers.image.licenses="Apache-2.0"
# No USER: ztunnel runs as root, restricted to the capabilities the DaemonSet grants
# (NET_ADMIN, SYS_ADMIN, NET_RAW; for eBPF capture also BPF, PERFMON, SYS_RESOURCE), since
# it enters pod network namespaces. Metrics 15020, readiness 15021 (admin 15000 stays on
# localhost).
EXPOSE 15020 15021
ENTRYPOINT ["/usr/local/bin/ztunnel"]
