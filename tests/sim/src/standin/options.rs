//! What a stand-in proxy is: its kind (which real proxy it stands in for) and its options, as
//! flags on its command line.
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};

use super::*;

/// Which proxy to imitate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyKind {
    /// pilot-agent status server :15020 (`POST /quitquitquit`, `GET /healthz/ready`), Envoy's health
    /// listener :15021 (`GET /healthz/ready`) and Envoy admin 127.0.0.1:15000 (whose quit only
    /// restarts Envoy under pilot-agent: it answers but the process stays).
    Istio,
    /// Envoy admin 127.0.0.1:15000: `POST /quitquitquit`, `GET /ready`.
    Envoy,
    /// linkerd-proxy admin :4191: `GET /ready`, `GET /live`, `POST /shutdown` (loopback only).
    Linkerd,
    /// cloud-sql-proxy v2: health :9090 (`/readiness`, `/liveness`, `/startup`), admin
    /// 127.0.0.1:9091 `/quitquitquit`.
    CloudSql,
    /// Vault Agent as vault-k8s injects it: its listener 127.0.0.1:8200 serves `POST
    /// /agent/v1/quit` (with `agent-enable-quit`; without, and without a cache, there is no
    /// listener: `--quit-disabled`); SIGTERM ends it with 0.
    Vault,
    /// consul-dataplane: its lifecycle server 127.0.0.1:20600 (consul-k8s's port) serves
    /// `/graceful_shutdown` (any method), Envoy's admin 127.0.0.1:19000 `/ready`; it exits 0 after
    /// its shutdown grace period (`--drain-ms`, 0 by default as consul-dataplane's own), on the
    /// endpoint or on SIGTERM.
    Consul,
    /// The AlloyDB Auth Proxy: as cloud-sql-proxy v2 (health :9090, admin 127.0.0.1:9091
    /// `/quitquitquit` with `--quitquitquit`; without it no admin listener: `--quit-disabled`;
    /// SIGTERM exits 143 without `--exit-zero-sigterm`).
    AlloyDb,
    /// kuma-dp: its readiness reporter :9902 `/ready`; no quit endpoint (Envoy's admin is on a Unix
    /// socket): SIGTERM starts a drain of `--drain-ms` (kuma-dp's drainTime, 30 s), a second one
    /// ends it at once; it exits 0.
    Kuma,
}

impl ProxyKind {
    pub fn parse(s: &str) -> Result<ProxyKind> {
        Ok(match s {
            "istio" => ProxyKind::Istio,
            "envoy" => ProxyKind::Envoy,
            "linkerd" => ProxyKind::Linkerd,
            "cloudsql" | "cloud-sql" | "cloud-sql-proxy" => ProxyKind::CloudSql,
            "vault" => ProxyKind::Vault,
            "consul" => ProxyKind::Consul,
            "alloydb" => ProxyKind::AlloyDb,
            "kuma" => ProxyKind::Kuma,
            other => bail!("unknown --kind {other:?} (istio|envoy|linkerd|cloudsql|vault|consul|alloydb|kuma)"),
        })
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyKind::Istio => "istio",
            ProxyKind::Envoy => "envoy",
            ProxyKind::Linkerd => "linkerd",
            ProxyKind::CloudSql => "cloudsql",
            ProxyKind::Vault => "vault",
            ProxyKind::Consul => "consul",
            ProxyKind::AlloyDb => "alloydb",
            ProxyKind::Kuma => "kuma",
        }
    }
}

/// Command-line options of the stand-in (see `--help`).
#[derive(Debug, Clone)]
pub struct StandinOptions {
    pub kind: ProxyKind,
    /// Not ready before this much time after start.
    pub ready_after: Option<Duration>,
    /// Ready only while this file exists.
    pub ready_file: Option<PathBuf>,
    /// With `ready_file`: once the file appears, bind this port (0.0.0.0) and only then turn
    /// ready, as Envoy binds the listeners its configuration brings (Istio's 15001 and 15006)
    /// just before it goes live. The moment is the kernel's to see; the health port listened
    /// from the start.
    pub listen_when_ready: Option<u16>,
    /// Accept connections but never answer.
    pub hang: bool,
    /// Answer every request with an endless body.
    pub flood: bool,
    /// Answer quit with success but keep running.
    pub quit_ignored: bool,
    /// Append `<CLOCK_MONOTONIC ns> <method> <path> <peer>` per request to this file.
    pub events: Option<PathBuf>,
    /// With `events`: each request's line also says when its bytes reached the socket
    /// (`arrived=<CLOCK_MONOTONIC ns>`, the kernel's receive timestamp: on loopback, the sender's
    /// write), so a request read late tells the reader's wait from the sender's; and, the line
    /// then written once the answer is out, when it was (`replied=<CLOCK_MONOTONIC ns>`).
    pub stamp_arrivals: bool,
    /// Istio status port (15020).
    pub status_port: Option<u16>,
    /// Istio health (15021) / cloud-sql-proxy health (9090) port.
    pub health_port: Option<u16>,
    /// Envoy admin (15000) / Linkerd admin (4191) / cloud-sql-proxy admin (9091) port.
    pub admin_port: Option<u16>,
    /// Bind address of the Envoy / cloud-sql-proxy admin listener (127.0.0.1).
    pub admin_addr: Option<IpAddr>,
    /// Delay between SIGTERM and exit (Istio's terminationDrainDuration: 5 s; others 0).
    pub drain: Option<Duration>,
    /// Exit code on SIGTERM (cloud-sql-proxy without --exit-zero-on-sigterm: 143; others 0).
    pub sigterm_exit_code: Option<i32>,
    /// Linkerd's default in recent releases: `/shutdown` is not served.
    pub linkerd_shutdown_disabled: bool,
    /// The quit's opt-in is off: Vault Agent without `agent-enable-quit` (and no cache: no
    /// listener at all), the AlloyDB Auth Proxy without `--quitquitquit` (no admin listener).
    pub quit_disabled: bool,
}

impl StandinOptions {
    pub fn new(kind: ProxyKind) -> StandinOptions {
        StandinOptions {
            kind,
            ready_after: None,
            ready_file: None,
            listen_when_ready: None,
            hang: false,
            flood: false,
            quit_ignored: false,
            events: None,
            stamp_arrivals: false,
            status_port: None,
            health_port: None,
            admin_port: None,
            admin_addr: None,
            drain: None,
            sigterm_exit_code: None,
            linkerd_shutdown_disabled: false,
            quit_disabled: false,
        }
    }

    /// The flags that reproduce these options.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec!["--kind".to_string(), self.kind.as_str().to_string()];
        let mut push = |k: &str, v: String| {
            a.push(k.to_string());
            a.push(v);
        };
        if let Some(d) = self.ready_after {
            push("--ready-after-ms", d.as_millis().to_string());
        }
        if let Some(p) = &self.ready_file {
            push("--ready-file", p.display().to_string());
        }
        if let Some(p) = self.listen_when_ready {
            push("--listen-when-ready", p.to_string());
        }
        if let Some(p) = &self.events {
            push("--events", p.display().to_string());
        }
        if let Some(p) = self.status_port {
            push("--status-port", p.to_string());
        }
        if let Some(p) = self.health_port {
            push("--health-port", p.to_string());
        }
        if let Some(p) = self.admin_port {
            push("--admin-port", p.to_string());
        }
        if let Some(ip) = self.admin_addr {
            push("--admin-addr", ip.to_string());
        }
        if let Some(d) = self.drain {
            push("--drain-ms", d.as_millis().to_string());
        }
        if let Some(c) = self.sigterm_exit_code {
            push("--sigterm-exit-code", c.to_string());
        }
        for (on, flag) in [
            (self.hang, "--hang"),
            (self.flood, "--flood"),
            (self.quit_ignored, "--quit-ignored"),
            (self.linkerd_shutdown_disabled, "--linkerd-shutdown-disabled"),
            (self.quit_disabled, "--quit-disabled"),
            (self.stamp_arrivals, "--stamp-arrivals"),
        ] {
            if on {
                a.push(flag.to_string());
            }
        }
        a
    }

    /// Parses the flags (without the program name).
    pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<StandinOptions> {
        let mut o = StandinOptions::new(ProxyKind::Istio);
        let mut it = args.into_iter();
        while let Some(flag) = it.next() {
            let (flag, inline) = match flag.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
                _ => (flag, None),
            };
            let mut value = |name: &str| -> Result<String> {
                match inline.clone() {
                    Some(v) => Ok(v),
                    None => it.next().ok_or_else(|| anyhow!("{name} needs a value")),
                }
            };
            let ms = |v: String| -> Result<Duration> {
                Ok(Duration::from_millis(v.parse().with_context(|| format!("bad number {v:?}"))?))
            };
            let port = |v: String| -> Result<u16> { v.parse().with_context(|| format!("bad port {v:?}")) };
            match flag.as_str() {
                "--kind" => o.kind = ProxyKind::parse(&value("--kind")?)?,
                "--ready-after-ms" => o.ready_after = Some(ms(value("--ready-after-ms")?)?),
                "--ready-file" => o.ready_file = Some(PathBuf::from(value("--ready-file")?)),
                "--listen-when-ready" => o.listen_when_ready = Some(port(value("--listen-when-ready")?)?),
                "--events" => o.events = Some(PathBuf::from(value("--events")?)),
                "--status-port" => o.status_port = Some(port(value("--status-port")?)?),
                "--health-port" => o.health_port = Some(port(value("--health-port")?)?),
                "--admin-port" => o.admin_port = Some(port(value("--admin-port")?)?),
                "--admin-addr" => o.admin_addr = Some(value("--admin-addr")?.parse().context("bad --admin-addr")?),
                "--drain-ms" => o.drain = Some(ms(value("--drain-ms")?)?),
                "--sigterm-exit-code" => {
                    o.sigterm_exit_code = Some(value("--sigterm-exit-code")?.parse().context("bad exit code")?)
                }
                "--stamp-arrivals" => o.stamp_arrivals = true,
                "--hang" => o.hang = true,
                "--flood" => o.flood = true,
                "--quit-ignored" => o.quit_ignored = true,
                "--linkerd-shutdown-disabled" => o.linkerd_shutdown_disabled = true,
                "--quit-disabled" => o.quit_disabled = true,
                other => bail!("unknown flag {other:?}\n{USAGE}"),
            }
        }
        if o.stamp_arrivals && o.events.is_none() {
            bail!("--stamp-arrivals needs --events");
        }
        if o.listen_when_ready.is_some() && o.ready_file.is_none() {
            bail!("--listen-when-ready needs --ready-file");
        }
        Ok(o)
    }

    /// Port and path of the readiness endpoint a kubelet would probe (Vault Agent has none: its
    /// listener's metrics answer once it serves).
    pub fn ready_endpoint(&self) -> (u16, &'static str) {
        match self.kind {
            ProxyKind::Istio => (self.health_port.unwrap_or(15021), "/healthz/ready"),
            ProxyKind::Envoy => (self.admin_port.unwrap_or(15000), "/ready"),
            ProxyKind::Linkerd => (self.admin_port.unwrap_or(4191), "/ready"),
            ProxyKind::CloudSql | ProxyKind::AlloyDb => (self.health_port.unwrap_or(9090), "/readiness"),
            ProxyKind::Vault => (self.admin_port.unwrap_or(8200), "/agent/v1/metrics"),
            ProxyKind::Consul => (self.admin_port.unwrap_or(19000), "/ready"),
            ProxyKind::Kuma => (self.health_port.unwrap_or(9902), "/ready"),
        }
    }

    /// Port and path of the quit endpoint (always `POST`).
    pub fn quit_endpoint(&self) -> (u16, &'static str) {
        match self.kind {
            ProxyKind::Istio => (self.status_port.unwrap_or(15020), "/quitquitquit"),
            ProxyKind::Envoy => (self.admin_port.unwrap_or(15000), "/quitquitquit"),
            ProxyKind::Linkerd => (self.admin_port.unwrap_or(4191), "/shutdown"),
            ProxyKind::CloudSql | ProxyKind::AlloyDb => (self.admin_port.unwrap_or(9091), "/quitquitquit"),
            ProxyKind::Vault => (self.admin_port.unwrap_or(8200), "/agent/v1/quit"),
            ProxyKind::Consul => (self.status_port.unwrap_or(20600), "/graceful_shutdown"),
            // None of its own: where Envoy's admin would be on TCP.
            ProxyKind::Kuma => (self.admin_port.unwrap_or(9901), "/quitquitquit"),
        }
    }

    pub(super) fn listeners(&self) -> Vec<(Role, SocketAddr)> {
        let any = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let admin = self.admin_addr.unwrap_or(lo);
        match self.kind {
            ProxyKind::Istio => vec![
                (Role::IstioStatus, SocketAddr::new(any, self.status_port.unwrap_or(15020))),
                (Role::IstioHealth, SocketAddr::new(any, self.health_port.unwrap_or(15021))),
                (Role::IstioEnvoyAdmin, SocketAddr::new(lo, self.admin_port.unwrap_or(15000))),
            ],
            ProxyKind::Envoy => vec![(Role::EnvoyAdmin, SocketAddr::new(admin, self.admin_port.unwrap_or(15000)))],
            ProxyKind::Linkerd => vec![(Role::LinkerdAdmin, SocketAddr::new(any, self.admin_port.unwrap_or(4191)))],
            ProxyKind::CloudSql | ProxyKind::AlloyDb => {
                let mut l = vec![(Role::CloudSqlHealth, SocketAddr::new(any, self.health_port.unwrap_or(9090)))];
                if !(self.kind == ProxyKind::AlloyDb && self.quit_disabled) {
                    l.push((Role::CloudSqlAdmin, SocketAddr::new(admin, self.admin_port.unwrap_or(9091))));
                }
                l
            }
            ProxyKind::Vault if self.quit_disabled => Vec::new(),
            ProxyKind::Vault => vec![(Role::VaultListener, SocketAddr::new(lo, self.admin_port.unwrap_or(8200)))],
            ProxyKind::Consul => vec![
                (Role::ConsulLifecycle, SocketAddr::new(lo, self.status_port.unwrap_or(20600))),
                (Role::EnvoyAdmin, SocketAddr::new(lo, self.admin_port.unwrap_or(19000))),
            ],
            ProxyKind::Kuma => vec![(Role::KumaReadiness, SocketAddr::new(any, self.health_port.unwrap_or(9902)))],
        }
    }

    /// The exit code on `sig` when no `--sigterm-exit-code` says otherwise: cloud-sql-proxy and
    /// the AlloyDB Auth Proxy die of SIGTERM (143) unless told to exit 0; the others exit 0.
    pub(super) fn default_exit_code(&self, sig: nix::sys::signal::Signal) -> i32 {
        let dies_of_sigterm = matches!(self.kind, ProxyKind::CloudSql | ProxyKind::AlloyDb);
        if dies_of_sigterm && sig == nix::sys::signal::Signal::SIGTERM { 143 } else { 0 }
    }

    /// How long it takes to exit after a stop signal when `--drain-ms` does not say: Istio's
    /// terminationDrainDuration (5 s), kuma-dp's drainTime (30 s); the others at once.
    pub(super) fn default_drain(&self) -> Duration {
        match self.kind {
            ProxyKind::Istio => Duration::from_secs(5),
            ProxyKind::Kuma => Duration::from_secs(30),
            _ => Duration::ZERO,
        }
    }
}

pub const USAGE: &str = "usage: valet-standin-proxy [--kind istio|envoy|linkerd|cloudsql|vault|consul|alloydb|kuma]
       [--ready-after-ms N | --ready-file PATH]
       [--listen-when-ready PORT]
       [--hang] [--flood] [--quit-ignored] [--events PATH [--stamp-arrivals]]
       [--status-port N] [--health-port N] [--admin-port N] [--admin-addr IP]
       [--drain-ms N] [--sigterm-exit-code N] [--linkerd-shutdown-disabled] [--quit-disabled]";
