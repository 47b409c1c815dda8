//! `cargo xtask bench`: valet's performance figures (the sections are in `tests/src/bench/`).
#[path = "../bench/mod.rs"]
mod bench;

fn main() -> anyhow::Result<()> {
    bench::main()
}
