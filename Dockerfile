# syntax=docker/dockerfile:1
#
# valet-agent container image: ghcr.io/valet-dev/valet-agent
#
# Build from the repository root (needs BuildKit, for the cache mounts):
#
#   docker buildx build --platform linux/amd64,linux/arm64 -t ghcr.io/valet-dev/valet-agent:0.1.0 .
#
# One image index of both architectures the DaemonSet selects. The build stage runs on the build
# machine's own platform (BUILDPLATFORM, no emulation) and cross-compiles for each TARGETARCH with
# Debian's cross gcc and glibc, as `cargo xtask image` does (.cargo/config.toml names the aarch64
# linker); the BPF object is the same for both (agent/build.rs builds it once). The final stage is
# distroless's image of the target platform.
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
# The multi-arch image that the tests build and run is `cargo xtask image`'s (docs/dev/testing.md):
# no container engine runs this file there.
#
# Not built by the tests (no container engine there); deploy/tests/test_checkov.py scans it
# statically with checkov, and the two findings accepted are suppressed in place below.

ARG RUST_VERSION=1.95

FROM --platform=$BUILDPLATFORM rust:${RUST_VERSION}-bookworm AS build

ARG BPF_LINKER_VERSION=0.13.0
# Set by BuildKit from --platform: the image's architecture, and the build machine's.
ARG TARGETARCH
ARG BUILDARCH

# LLVM 22 (headers, libraries, llvm-config) for bpf-linker.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*

# The target's Rust standard library, and its cross gcc and glibc where it is not the build
# machine's: only amd64 and arm64 (the DaemonSet's affinity).
RUN case "${TARGETARCH}" in \
      amd64) triple=x86_64-unknown-linux-gnu; cross=gcc-x86-64-linux-gnu; libc=libc6-dev-amd64-cross ;; \
      arm64) triple=aarch64-unknown-linux-gnu; cross=gcc-aarch64-linux-gnu; libc=libc6-dev-arm64-cross ;; \
      *) echo "TARGETARCH ${TARGETARCH}: valet is built for amd64 and arm64 only" >&2; exit 1 ;; \
    esac \
 && echo "${triple}" > /target-triple \
 && rustup target add "${triple}" \
 && if [ "${TARGETARCH}" != "${BUILDARCH}" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends "${cross}" "${libc}" \
      && rm -rf /var/lib/apt/lists/*; \
    fi

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
# the image's own toolchain (its rustup name, e.g. 1.95.0-x86_64-unknown-linux-gnu). Each
# target's linker is its gcc (Debian's triplet names, native or cross).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    triple="$(cat /target-triple)" \
 && VALET_EBPF_TOOLCHAIN="$(rustup show active-toolchain | cut -d' ' -f1)" \
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER=x86_64-linux-gnu-gcc \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    cargo build --release --locked -p valet-agent --target "${triple}" \
 && install -D -m 0755 "target/${triple}/release/valet-agent" /out/valet-agent

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
