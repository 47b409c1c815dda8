//! A pod as the API returns it, with annotations (and container names, images, restart policy)
//! chosen by its owner: `pod::spec::plan` must answer with a plan or an error, never panic,
//! and a plan's sidecar endpoints stay on the pod's loopback ports it names, with paths that
//! cannot break the request line.
#![no_main]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use valet_agent::pod::spec::{SidecarDefaults, plan};

/// Key prefixes the fuzzer picks from, so that it reaches every annotation valet reads.
const PREFIXES: [&str; 15] = [
    "",
    "valet.dev/",
    "valet.dev/sidecars",
    "valet.dev/sidecar-kind.",
    "valet.dev/quit-port.",
    "valet.dev/ready-port.",
    "valet.dev/quit-path.",
    "valet.dev/ready-path.",
    "valet.dev/quit-signal.",
    "valet.dev/hold-app",
    "valet.dev/hold-timeout",
    "status.sidecar.istio.io/port",
    "proxy.istio.io/config",
    "vault.hashicorp.com/agent-enable-quit",
    "vault.hashicorp.com/agent-cache-listener-port",
];
const NAMES: [&str; 9] = [
    "app",
    "istio-proxy",
    "linkerd-proxy",
    "cloud-sql-proxy",
    "envoy",
    "vault-agent",
    "consul-dataplane",
    "kuma-sidecar",
    "alloydb-auth-proxy",
];
const POLICIES: [Option<&str>; 4] = [None, Some("Never"), Some("OnFailure"), Some("Always")];

#[derive(Arbitrary, Debug)]
struct Input {
    annotations: Vec<(u8, String, String)>,
    containers: Vec<(u8, String, String)>,
    init_containers: Vec<(u8, bool)>,
    restart_policy: u8,
}

fn name(pick: u8, own: &str) -> String {
    match NAMES.get(usize::from(pick)) {
        Some(n) => (*n).to_owned(),
        None => own.to_owned(),
    }
}

fuzz_target!(|input: Input| {
    let annotations: BTreeMap<String, String> = input
        .annotations
        .iter()
        .map(|(p, suffix, value)| (format!("{}{suffix}", PREFIXES[usize::from(*p) % PREFIXES.len()]), value.clone()))
        .collect();
    let containers = input
        .containers
        .iter()
        .map(|(pick, own, image)| Container {
            name: name(*pick, own),
            image: Some(image.clone()),
            ..Default::default()
        })
        .collect();
    let init = input
        .init_containers
        .iter()
        .map(|(pick, native)| Container {
            name: name(*pick, "init"),
            restart_policy: native.then(|| "Always".to_owned()),
            ..Default::default()
        })
        .collect();
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("job".into()),
            namespace: Some("team".into()),
            uid: Some("0f5c9b6e-3a7d-4e21-9b8a-1c2d3e4f5a6b".into()),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers,
            init_containers: Some(init),
            restart_policy: POLICIES[usize::from(input.restart_policy) % POLICIES.len()].map(str::to_owned),
            ..Default::default()
        }),
        status: None,
    };
    if let Ok(plan) = plan(&pod, &SidecarDefaults::default()) {
        for s in &plan.sidecars {
            let ports = s.quit.iter().chain(s.ready.iter()).map(|e| e.port);
            assert!(ports.into_iter().all(|p| p != 0), "{s:?}");
            // A path goes into the request line as is: nothing that could end it or add a header.
            let paths = s.quit.iter().chain(s.ready.iter()).map(|e| e.path.as_str());
            assert!(paths.into_iter().all(|p| p.starts_with('/') && p.bytes().all(|b| b.is_ascii_graphic())), "{s:?}");
        }
    }
});
