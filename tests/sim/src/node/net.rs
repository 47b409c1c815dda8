//! A sim pod's network: its netns and veth to the host, with a /30 subnet claimed among every
//! process on the host (`ip`, the IPAM lock, the subnet claims).
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use super::*;

impl SimPod {
    pub(super) fn setup_net(&mut self) -> Result<()> {
        let short = self.short.clone();
        let ns_name = format!("valet-{short}");
        let host_if = format!("vh-{short}");
        ip(&["netns", "add", &ns_name])?;
        self.netns_created = Some(ns_name.clone());
        // A claimed subnet: pods made in parallel set their networks up without waiting for
        // each other.
        let claim = SubnetClaim::claim(&host_if)?;
        let n = claim.n;
        self.subnet = Some(claim);
        let host_ip = Ipv4Addr::new(10, 244, n, 1);
        let pod_ip = Ipv4Addr::new(10, 244, n, 2);
        // Two `ip -batch` runs (the host's side, then the pod's) rather than ten processes: pod
        // setup is what bounds the benchmarks' Jobs per second. The pod's end is made in its
        // namespace as `eth0`, as CNI's bridge and ptp plugins do: moving a device between
        // namespaces waits for an RCU grace period under the kernel's rtnl lock (about 20 ms a
        // pod here, and pods made at once wait for each other's).
        ip_batch(
            &[],
            &[
                format!("link add {host_if} type veth peer name eth0 netns {ns_name}"),
                format!("addr add {host_ip}/24 dev {host_if}"),
                format!("link set {host_if} up"),
            ],
        )?;
        ip_batch(
            &["-n", &ns_name],
            &[
                format!("addr add {pod_ip}/24 dev eth0"),
                "link set eth0 up".into(),
                "link set lo up".into(),
                format!("route add default via {host_ip}"),
            ],
        )?;
        self.net =
            Some(PodNet { ns_path: PathBuf::from(format!("/run/netns/{ns_name}")), ns_name, host_if, pod_ip, host_ip });
        Ok(())
    }
}

pub(super) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Runs `ip <opts> -batch -` with `lines` as its commands.
pub(super) fn ip_batch(opts: &[&str], lines: &[String]) -> Result<()> {
    use std::io::Write as _;
    let mut child = Command::new("ip")
        .args(opts)
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("run ip (iproute2)")?;
    let script: String = lines.iter().map(|l| format!("{l}\n")).collect();
    child.stdin.take().context("ip's stdin")?.write_all(script.as_bytes()).context("write to ip -batch")?;
    let out = child.wait_with_output().context("wait for ip")?;
    if !out.status.success() {
        bail!("ip {} -batch: {}: {}", opts.join(" "), lines.join("; "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

pub(super) fn ip_output(args: &[&str]) -> Result<String> {
    let out = Command::new("ip").args(args).output().context("run ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A host-wide lock (flock) around subnet allocation, shared by all test processes.
pub(super) struct IpamLock {
    _file: File,
}

impl IpamLock {
    pub(super) fn acquire() -> Result<IpamLock> {
        let dir = sim_state_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("ipam.lock"))
            .context("open the ipam lock")?;
        // SAFETY: plain syscall on a valid fd; the lock is released when the file closes.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io::Error::last_os_error()).context("flock");
        }
        Ok(IpamLock { _file: f })
    }
}

/// A pod's 10.244.N.0/24, claimed by a file naming its owner process (pid and start time) and the
/// host's end of its veth pair, so that pods made at once in threads and processes never share
/// one and run their `ip` commands in parallel. A claim whose owner died is taken over once its
/// device is gone; the host's own addresses and routes are read once per process and never
/// claimed. A pod's drop releases its claim (`released DEVICE`), but the subnet is only used
/// again once the kernel has removed that device with the pod's namespace: until then its
/// address and route are still there.
#[derive(Debug)]
pub(super) struct SubnetClaim {
    n: u8,
    path: PathBuf,
    host_if: String,
}

/// Whether a network device of this name is in the host's namespace.
pub(super) fn link_exists(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && Path::new("/sys/class/net").join(name).exists()
}

/// What a subnet's claim file says.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ClaimState {
    Free,
    Taken,
    /// Released or its owner is gone, but its device is still there.
    Draining,
}

pub(super) fn claim_state(text: &str) -> ClaimState {
    let fields: Vec<&str> = text.split_whitespace().collect();
    let device_gone = |d: Option<&&str>| d.is_none_or(|d| !link_exists(d));
    match fields.as_slice() {
        ["released", rest @ ..] => {
            if device_gone(rest.first()) {
                ClaimState::Free
            } else {
                ClaimState::Draining
            }
        }
        [pid, start, rest @ ..] => match (pid.parse::<u32>(), start.parse::<u64>()) {
            (Ok(pid), Ok(start)) if process_start_time(pid) == Some(start) => ClaimState::Taken,
            (Ok(_), Ok(_)) if !device_gone(rest.first()) => ClaimState::Draining,
            _ => ClaimState::Free,
        },
        _ => ClaimState::Free,
    }
}

impl SubnetClaim {
    /// Claims a free subnet for a pod whose host device is `host_if`; waits up to 10 s while
    /// released ones are still draining.
    pub(super) fn claim(host_if: &str) -> Result<SubnetClaim> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match SubnetClaim::try_claim(host_if)? {
                Ok(claim) => return Ok(claim),
                Err(draining) if draining > 0 && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(draining) => bail!("no free 10.244.N.0/24 subnet left ({draining} waiting for their device to go)"),
            }
        }
    }

    /// A claim, or how many subnets are draining.
    pub(super) fn try_claim(host_if: &str) -> Result<std::result::Result<SubnetClaim, usize>> {
        static HOST_USED: std::sync::OnceLock<std::collections::BTreeSet<u8>> = std::sync::OnceLock::new();
        let _lock = IpamLock::acquire()?;
        let subnets = subnet_dir();
        std::fs::create_dir_all(&subnets).with_context(|| format!("mkdir {}", subnets.display()))?;
        let host_used = match HOST_USED.get() {
            Some(used) => used,
            None => {
                let text = ip_output(&["-4", "-o", "addr", "show"])? + &ip_output(&["-4", "route", "show"])?;
                // Subnets with a claim file are pods' (released with them), not the host's.
                let used = (1..=254u8)
                    .filter(|n| text.contains(&format!("10.244.{n}.")))
                    .filter(|n| !subnets.join(n.to_string()).exists())
                    .collect();
                HOST_USED.get_or_init(|| used)
            }
        };
        let me = std::process::id();
        let owner = format!("{me} {} {host_if}", process_start_time(me).unwrap_or(0));
        let mut draining = 0;
        for n in (1..=254u8).filter(|n| !host_used.contains(n)) {
            let path = subnets.join(n.to_string());
            let state = match std::fs::read_to_string(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => ClaimState::Free,
                Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
                Ok(text) => claim_state(&text),
            };
            match state {
                ClaimState::Free => {
                    std::fs::write(&path, &owner).with_context(|| format!("write {}", path.display()))?;
                    return Ok(Ok(SubnetClaim { n, path, host_if: host_if.to_string() }));
                }
                ClaimState::Draining => draining += 1,
                ClaimState::Taken => {}
            }
        }
        Ok(Err(draining))
    }
}

impl Drop for SubnetClaim {
    fn drop(&mut self) {
        let _lock = IpamLock::acquire();
        let _ = std::fs::write(&self.path, format!("released {}", self.host_if));
    }
}
