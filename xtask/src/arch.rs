//! The architectures the VMs boot and the binaries are built for.

/// A kernel's architecture: the host's (amd64), or arm64 under qemu-system-aarch64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    /// Debian's name.
    pub(crate) const fn deb(self) -> &'static str {
        match self {
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    /// Rust's target.
    pub(crate) const fn triple(self) -> &'static str {
        match self {
            Self::Amd64 => "x86_64-unknown-linux-gnu",
            Self::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// The architecture this xtask runs on.
    pub(crate) const fn host() -> Self {
        if cfg!(target_arch = "aarch64") { Self::Arm64 } else { Self::Amd64 }
    }
}
