//! The fake API server as a process of its own, for a node where the kubelet is a stand-in in
//! another process (the real-node VM): `valet-fake-apiserver <kubeconfig>` writes a kubeconfig
//! pointing at it, prints its URL and serves until it is killed.
use anyhow::{Context as _, Result};
use valet_sim::apiserver::FakeApiServer;

fn main() -> Result<()> {
    let kubeconfig = std::env::args().nth(1).context("usage: valet-fake-apiserver <kubeconfig path to write>")?;
    let server = FakeApiServer::start()?;
    server.write_kubeconfig(&kubeconfig)?;
    println!("{}", server.url());
    loop {
        std::thread::park();
    }
}
