# syntax=docker/dockerfile:1
#
# valet-agent container image: ghcr.io/valet-dev/valet-agent
#
# Build from the repository root (needs BuildKit, for the cache mounts):
#
#   docker buildx build --platform linux/amd64 -t ghcr.io/valet-dev/valet-agent:0.1.0 .
#
# Stages:
#   build  rust:<RUST_VERSION>-bookworm builds the agent. agent/build.rs (as aya-build would) also
#          builds the kernel programs in agent-ebpf for bpfel-unknown-none with
#          `-Z build-std=core`, which needs the standard library's source (rust-src) and
#          bpf-linker. bpf-linker reads the LLVM bitcode rustc emits, so it must be built
#          against the same LLVM major version as that rustc: Rust 1.95 uses LLVM 22, and
#          Debian 12 ships llvm-22-dev (bookworm-security). This is the combination
#          `cargo xtask setup` installs and CI builds with: the image's stable compiler
#          builds the BPF object too (agent/build.rs sets RUSTC_BOOTSTRAP=1 for a
#          non-nightly toolchain). To use a nightly instead, install it with rust-src,
#          pass its name in VALET_EBPF_TOOLCHAIN, and build bpf-linker against its LLVM.
#   final  gcr.io/distroless/cc-debian12 (glibc and libgcc, no shell, no package manager)
#          holding only /usr/local/bin/valet-agent, with the eBPF object embedded. It runs
#          as root: the agent needs uid 0 for the capabilities deploy/base/daemonset.yaml grants
#          (the reasons are there).
#
# Build arguments:
#   RUST_VERSION        Rust release of the build image (default 1.95; keep its LLVM at 22)
#   BPF_LINKER_VERSION  bpf-linker from crates.io (default 0.13.0, built with feature llvm-22)
#
# Written for linux/amd64; both base images and llvm-22-dev also exist for arm64 (this Dockerfile
# is untried there). The multi-arch image that is tested, linux/amd64 and linux/arm64 with one BPF
# object, is `cargo xtask image`'s (docs/dev/testing.md).
#
# Not built by the tests (no container engine there); deploy/tests/test_checkov.py scans it
# statically with checkov, and the two findings accepted are suppressed in place below.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS build

ARG BPF_LINKER_VERSION=0.13.0

# LLVM 22 (headers, libraries, llvm-config) for bpf-linker.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*

# The BPF toolchain: rust-src for -Z build-std=core, and the BPF linker.
RUN rustup component add rust-src \
 && PATH="/usr/lib/llvm-22/bin:${PATH}" \
    LLVM_SYS_221_PREFIX=/usr/lib/llvm-22 \
    LLVM_SYS_220_PREFIX=/usr/lib/llvm-22 \
    cargo install --locked bpf-linker --version "${BPF_LINKER_VERSION}" \
      --no-default-features --features llvm-22

WORKDIR /src
COPY . .

# target/ is a cache mount, so the binary is copied out in the same step. The BPF build uses
# the image's own toolchain (its rustup name, e.g. 1.95.0-x86_64-unknown-linux-gnu).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    VALET_EBPF_TOOLCHAIN="$(rustup show active-toolchain | cut -d' ' -f1)" \
    cargo build --release --locked -p valet-agent \
 && install -D -m 0755 target/release/valet-agent /out/valet-agent

# checkov:skip=CKV_DOCKER_7: distroless publishes no version tags (latest, nonroot, debug); pin the digest for releases
# checkov:skip=CKV_DOCKER_2: no HEALTHCHECK - Kubernetes ignores it and probes /healthz and /readyz instead (deploy/base/daemonset.yaml), and distroless has no shell or client to run one
FROM gcr.io/distroless/cc-debian12:latest

LABEL org.opencontainers.image.title="valet-agent" \
      org.opencontainers.image.description="valet node agent: ends sidecars when a Job's work is done and holds apps until the proxy is ready" \
      org.opencontainers.image.source="https://github.com/valet-dev/valet" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY --from=build /out/valet-agent /usr/local/bin/valet-agent

# Root on purpose (see above); the DaemonSet sets runAsUser 0 too.
USER 0:0
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/valet-agent"]
