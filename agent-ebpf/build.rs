//! Rebuild the kernel programs when the bpf-linker binary changes: it is an undeclared
//! dependency of every BPF build.
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
