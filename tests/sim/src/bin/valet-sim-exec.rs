//! Starts one container process for the simulated node, as `runc init` does for a real one: it
//! joins the container's cgroup and the pod's network namespace, takes its uid, waits its exec
//! delay and execs the container's command; with `--pidns` the command is pid 1 of a new pid
//! namespace, under this process, which waits for it and ends the same way it ended (exit code or
//! signal), as containerd's shim is the parent of a container's init. With `--join-pidns PATH` it
//! joins that pid namespace instead (shareProcessNamespace: the sandbox's), where the command is
//! pid N, still under this process.
//!
//! The simulated node starts it with `posix_spawn` (a vfork), so starting a container no longer
//! forks the whole test process: on these VMs that fork (page tables of a large, many-threaded
//! process, then copy-on-write faults in all its threads) cost more than everything else a Job
//! does. See `valet_sim::node::SimPod::spawn`.
//!
//! Usage: `valet-sim-exec [--cgroup-procs PATH] [--netns PATH] [--uid N] [--delay-ns N] [--cwd DIR]
//! [--pidns | --join-pidns PATH] [--host-pid N] -- PROGRAM ARGS...`
//!
//! fd 0 is the write end of a status pipe (the command gets /dev/null as its stdin). Written to
//! it: `pid N` (with `--pidns` or `--join-pidns`: the command's host pid), or `err ERRNO WHAT` when a step before the
//! exec failed (then the exit code is 127). It reaches end of file when the command has exec'd.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::{OsStrExt as _, OsStringExt as _};

#[derive(Default)]
struct Opts {
    cgroup_procs: Option<CString>,
    netns: Option<CString>,
    uid: Option<libc::uid_t>,
    delay_ns: u64,
    cwd: Option<CString>,
    pidns: bool,
    join_pidns: Option<CString>,
    /// `--host-pid N`: the command should get host pid N (a pid freed just before, reused).
    host_pid: Option<u32>,
    argv: Vec<CString>,
}

fn cstring(s: OsString) -> Result<CString, String> {
    CString::new(s.into_vec()).map_err(|_| "an argument contains a NUL byte".to_string())
}

fn parse(mut args: impl Iterator<Item = OsString>) -> Result<Opts, String> {
    let mut o = Opts::default();
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_bytes() {
            b"--cgroup-procs" => o.cgroup_procs = Some(cstring(value("--cgroup-procs")?)?),
            b"--netns" => o.netns = Some(cstring(value("--netns")?)?),
            b"--uid" => {
                let v = value("--uid")?;
                o.uid = Some(v.to_string_lossy().parse().map_err(|_| format!("--uid {v:?}"))?);
            }
            b"--delay-ns" => {
                let v = value("--delay-ns")?;
                o.delay_ns = v.to_string_lossy().parse().map_err(|_| format!("--delay-ns {v:?}"))?;
            }
            b"--cwd" => o.cwd = Some(cstring(value("--cwd")?)?),
            b"--pidns" => o.pidns = true,
            b"--join-pidns" => o.join_pidns = Some(cstring(value("--join-pidns")?)?),
            b"--host-pid" => {
                let v = value("--host-pid")?;
                o.host_pid = Some(v.to_string_lossy().parse().map_err(|_| format!("--host-pid {v:?}"))?);
            }
            b"--" => {
                o.argv = args.map(cstring).collect::<Result<_, _>>()?;
                break;
            }
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    if o.argv.is_empty() {
        return Err("no command after --".into());
    }
    if o.pidns && o.join_pidns.is_some() {
        return Err("--pidns and --join-pidns exclude each other".into());
    }
    Ok(o)
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Writes one status line (a short write to a pipe is atomic).
fn say(status: i32, line: &str) {
    // SAFETY: a valid buffer and length; a failed write leaves nothing to do.
    unsafe { libc::write(status, line.as_ptr().cast(), line.len()) };
}

/// Reports a failed step and ends this process.
fn fail(status: i32, err: i32, what: &str) -> ! {
    say(status, &format!("err {err} {what}\n"));
    // SAFETY: ends this process without running anything else of it.
    unsafe { libc::_exit(127) }
}

/// The container's side: its cgroup, network, ids, session, delay, then the exec.
fn setup_and_exec(o: &Opts, status: i32) -> ! {
    if let Some(p) = &o.cgroup_procs {
        // SAFETY: a valid C string; the fd is closed right after.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            fail(status, errno(), &format!("open {}", p.to_string_lossy()));
        }
        // "0" means the writing process itself, whatever pid namespace it is in.
        // SAFETY: a valid fd and buffer.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } < 0 {
            fail(status, errno(), &format!("join the cgroup ({})", p.to_string_lossy()));
        }
        // SAFETY: our own fd.
        unsafe { libc::close(fd) };
    }
    if let Some(p) = &o.netns {
        // SAFETY: a valid C string.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            fail(status, errno(), &format!("open {}", p.to_string_lossy()));
        }
        // SAFETY: a valid fd to a network namespace; this process is single-threaded.
        if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
            fail(status, errno(), &format!("setns {}", p.to_string_lossy()));
        }
        // SAFETY: our own fd.
        unsafe { libc::close(fd) };
    }
    if let Some(id) = o.uid {
        // SAFETY: plain syscalls.
        let ok = unsafe {
            libc::setgroups(0, std::ptr::null()) == 0
                && libc::setresgid(id, id, id) == 0
                && libc::setresuid(id, id, id) == 0
        };
        if !ok {
            fail(status, errno(), &format!("take uid {id}"));
        }
    }
    // Own session: ^C in the test's terminal must not reach the container.
    // SAFETY: plain syscall.
    unsafe { libc::setsid() };
    if o.delay_ns > 0 {
        std::thread::sleep(std::time::Duration::from_nanos(o.delay_ns));
    }
    if let Some(d) = &o.cwd {
        // SAFETY: a valid C string.
        if unsafe { libc::chdir(d.as_ptr()) } != 0 {
            fail(status, errno(), &format!("chdir {}", d.to_string_lossy()));
        }
    }
    let mut argv: Vec<*const libc::c_char> = o.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // SAFETY: a NUL-terminated array of valid C strings; the status fd is O_CLOEXEC, so the
    // pipe reaches end of file at the exec.
    unsafe { libc::execvp(argv[0], argv.as_ptr()) };
    fail(status, errno(), &format!("exec {}", o.argv[0].to_string_lossy()))
}

/// Ends this process the way `wstatus` says the command ended.
fn mirror(wstatus: i32) -> ! {
    if libc::WIFSIGNALED(wstatus) {
        let sig = libc::WTERMSIG(wstatus);
        // SAFETY: plain syscalls; the default action of `sig` ends this process as it ended the
        // command (for signals that terminate by default).
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::raise(sig);
            libc::_exit(128 + sig)
        }
    }
    let code = if libc::WIFEXITED(wstatus) { libc::WEXITSTATUS(wstatus) } else { 126 };
    // SAFETY: ends this process.
    unsafe { libc::_exit(code) }
}

fn main() {
    // The status pipe: moved off fd 0 (close-on-exec), /dev/null put in its place.
    // SAFETY: plain fcntl on fd 0, which the spawner set.
    let status = unsafe { libc::fcntl(0, libc::F_DUPFD_CLOEXEC, 3) };
    if status < 0 {
        eprintln!("valet-sim-exec: fd 0 must be the status pipe");
        std::process::exit(126);
    }
    // SAFETY: a valid C string literal; dup2 onto fd 0 closes our copy of the pipe there.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null < 0 || libc::dup2(null, 0) < 0 {
            fail(status, errno(), "open /dev/null as stdin");
        }
        libc::close(null);
    }
    let o = match parse(std::env::args_os().skip(1)) {
        Ok(o) => o,
        Err(e) => fail(status, libc::EINVAL, &format!("valet-sim-exec: {e}")),
    };
    if let Some(p) = &o.join_pidns {
        // SAFETY: a valid C string.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            fail(status, errno(), &format!("open {}", p.to_string_lossy()));
        }
        // SAFETY: a valid fd to a pid namespace; only this process' later children enter it.
        if unsafe { libc::setns(fd, libc::CLONE_NEWPID) } != 0 {
            fail(status, errno(), &format!("setns {}", p.to_string_lossy()));
        }
        // SAFETY: our own fd.
        unsafe { libc::close(fd) };
    } else if !o.pidns {
        setup_and_exec(&o, status);
    } else {
        // SAFETY: plain syscall; only this (single-threaded) process' later children are affected.
        if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
            fail(status, errno(), "unshare(CLONE_NEWPID)");
        }
    }
    if let Some(want) = o.host_pid {
        // The host's pid allocator hands out the pid after `ns_last_pid` next, if free: the
        // command reuses pid `want` unless another fork on the host comes in between (the caller
        // checks the pid it is told). A failed write leaves the pid to the allocator.
        let _ = std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", want.saturating_sub(1)));
    }
    // SAFETY: this process is single-threaded, so the child may run anything.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        fail(status, errno(), "fork");
    }
    if pid == 0 {
        setup_and_exec(&o, status);
    }
    say(status, &format!("pid {pid}\n"));
    // SAFETY: our own fd; the child keeps its copy until its exec.
    unsafe { libc::close(status) };
    let mut wstatus = 0;
    loop {
        // SAFETY: a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut wstatus, 0) };
        if r == pid {
            mirror(wstatus);
        }
        if r < 0 && errno() != libc::EINTR {
            // SAFETY: ends this process.
            unsafe { libc::_exit(126) }
        }
    }
}
