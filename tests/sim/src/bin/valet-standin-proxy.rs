//! A stand-in sidecar proxy for valet's tests, demo and benchmarks: the readiness and quit
//! endpoints of Istio, Envoy, Linkerd or cloud-sql-proxy. See `valet_sim::standin`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{}", valet_sim::standin::USAGE);
        return;
    }
    let opts = match valet_sim::standin::StandinOptions::parse_args(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("valet-standin-proxy: {e:#}");
            std::process::exit(2);
        }
    };
    if let Err(e) = valet_sim::standin::run(opts) {
        eprintln!("valet-standin-proxy: {e:#}");
        std::process::exit(1);
    }
}
