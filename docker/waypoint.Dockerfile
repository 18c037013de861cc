# syntax=docker/dockerfile:1
# ztunnel-rs waypoint image. Build from the repository root (BuildKit required):
#
#   docker build -f docker/waypoint.Dockerfile -t ztunnel-rs.local/waypoint:dev .
#
# or `bash scripts/build-images.sh`.

ARG RUST_IMAGE=rust:1.95.0-bookworm
# glibc 2.36 + libgcc_s, the same Debian 12 base as the builder; no shell, no package
# manager.
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS builder
# The waypoint links the ztunnel library, which embeds the eBPF capture programs, so the
# build needs the same toolchain as ztunnel's: clang/llvm, libbpf-dev and the kernel UAPI
# headers for ebpf/build.rs, gcc for ring (protos compile in Rust, no protoc).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      clang llvm libbpf-dev linux-libc-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,id=ztunnel-rs-target \
    cargo build --release --locked -p waypoint \
 && install -D -m 0755 target/release/waypoint /out/waypoint

FROM ${RUNTIME_IMAGE}
COPY --from=builder /out/waypoint /usr/local/bin/waypoint
LABEL org.opencontainers.image.title="ztunnel-rs waypoint" \
      org.opencontainers.image.description="Ambient mesh waypoint (HTTPRoute, L7 AuthorizationPolicy over HBONE)" \
      org.opencontainers.image.licenses="Apache-2.0"
# Non-root, no capabilities needed: HBONE 15008, metrics 15020, readiness 15021.
USER 1337:1337
EXPOSE 15008 15020 15021
ENTRYPOINT ["/usr/local/bin/waypoint"]
