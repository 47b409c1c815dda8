//! Privileged tests of the kernel programs: real programs, real cgroups in the kubelet's
//! layouts, real processes in real pid namespaces, exact events.
//!
//! A "container" here is what a runtime makes: a process that execs in the container cgroup in
//! the host's pid namespace (`unshare`, like runc ≥ 1.2's `runc init` started there with
//! CLONE_INTO_CGROUP) and starts the container's main process in a new pid namespace, or in the
//! pod's shared one (`nsenter`, shareProcessNamespace).
//!
//! Every scenario runs twice, once per way the programs find a pod cgroup: the
//! `bpf_get_current_ancestor_cgroup_id` helper (`helper::*`) and the walk up
//! `cgroup->kn->parent` that 5.10 needs (`walk::*`). Most run a third time with every cgroup in
//! a cgroup v1 controller's hierarchy (`v1::*`), as on v1 and hybrid nodes, where the programs
//! read `task->cgroups->subsys[id]` and walk that hierarchy.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use valet_agent::host::container_main::find_container_main;
use valet_agent::kernel::programs::{AncestorMode, RecordOutcome};
use valet_agent::kernel::{Attach, Event, ProcessEnd, Programs};
use valet_common::{Counter, container_flags, watch_flags};
use valet_tests::cgroups::require_root;
use valet_tests::kernel_suite::*;

async fn exit_zero_systemd_layout(mode: Way) {
    run_and_expect(mode, true, 1, &["/bin/true"], None, ProcessEnd::Exited(0)).await;
}

async fn exit_42_cgroupfs_layout(mode: Way) {
    run_and_expect(mode, false, 2, &["/bin/sh", "-c", "exit 42"], None, ProcessEnd::Exited(42)).await;
}

async fn killed_by_sigkill_from_the_host(mode: Way) {
    // Pid 1 of a namespace ignores signals without a handler from inside it; SIGKILL from an
    // ancestor namespace (the kubelet's runtime, here the test) ends it.
    let end = ProcessEnd::Signaled { signal: 9, core_dumped: false };
    run_and_expect(mode, true, 3, &["sleep", "30"], Some(libc::SIGKILL), end).await;
}

async fn multithreaded_main_reports_once_when_workers_exit_first(mode: Way) {
    // Worker threads exit first (thread exits, not process exits); then the process exits 5.
    let bin = env!("CARGO_BIN_EXE_valet-test-threads");
    run_and_expect(mode, true, 5, &[bin, "workers-first"], None, ProcessEnd::Exited(5)).await;
}

async fn multithreaded_main_reports_once_when_the_leader_exits_first(mode: Way) {
    // The main thread ends alone; the process ends when the last worker calls exit(6).
    let bin = env!("CARGO_BIN_EXE_valet-test-threads");
    run_and_expect(mode, false, 11, &[bin, "leader-first"], None, ProcessEnd::Exited(6)).await;
}

async fn pid_namespace_init_is_the_container_end_and_children_are_not(mode: Way) {
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, false, 6);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    // The main process (pid 1) runs a child that exits 7 first, then sleep, then exits 3.
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", "/bin/sh -c 'exit 7'; sleep 0.05; exit 3"]);
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "the main process only: {got:?}");
    let init = &got[0];
    assert_eq!(init.end, Some(ProcessEnd::Exited(3)));
    assert!(init.container_main && init.ns_init && init.child_pid_ns);
    assert_eq!(init.ns_pid, 1);
    // The child, sleep and unshare (the runtime) exited in the kernel's view only.
    assert!(programs.counter(Counter::ExitsFiltered) >= 3, "{}", programs.counter(Counter::ExitsFiltered));
    assert_eq!(programs.counter(Counter::ExitsReported), 1);
}

async fn a_nested_sandbox_init_never_ends_the_container(mode: Way) {
    // Chromium's sandbox, bwrap, `unshare -p` in a CI Job: pid 1 of a namespace below the
    // container's, made through a user namespace as unprivileged containers do. Its exit (3) is
    // not the container's end; the main process checks it ran and exits 5 afterwards.
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, true, 12);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let script = "unshare --user --map-root-user --pid --fork /bin/sh -c 'exit 3'; \
                  [ $? -eq 3 ] || exit 99; sleep 0.3; exit 5";
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", script]);
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "the main process only: {got:?}");
    assert_eq!(programs.counter(Counter::ExitsReported), 1, "nothing else");
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(5)), "the nested init ran and exited 3 first");
    assert!(got[0].container_main && got[0].ns_init);
    assert!(programs.counter(Counter::ExitsFiltered) >= 3, "nested init, its unshare, the runtime");
}

async fn shared_pid_namespace_main_is_not_pid_1_and_still_ends_its_container(mode: Way) {
    // shareProcessNamespace: the sandbox's pause is pid 1 of the pod's namespace; the app
    // container's main process joins it (pid 2, 3...) in a cgroup of its own.
    let (mut programs, mut stream) = load(mode);
    let mut pod = Pod::new(mode, true, 13);
    let sandbox_rel = pod.add_container(14);
    let sandbox = pod.id(&sandbox_rel);
    let app = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let mut pause = pod.start(&sandbox_rel, &["sleep", "60"]);
    let pause_main = recorded_main(&programs, sandbox).await;
    assert!(pause_main.flags & container_flags::NS_INIT != 0);
    // The app runs a child first (filtered), then ends by SIGTERM (it is not pid 1, so the
    // signal's default action applies).
    let mut child = pod.start_shared(
        &pod.container_rel,
        pause_main.tgid,
        &["/bin/sh", "-c", "/bin/true; sleep 0.2; kill -TERM $$"],
    );
    let record = recorded_main(&programs, app).await;
    assert_ne!(record.tgid, child.id(), "nsenter (host namespace) is not the main");
    assert_eq!(record.flags, container_flags::BY_EXEC, "not pid 1 of its namespace");
    assert_eq!(record.pidns_depth, 1);
    assert_eq!(record.pidns_inum, pause_main.pidns_inum, "the pod's shared namespace");
    let got = exits(&mut stream, app, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "the main process only: {got:?}");
    let exit = &got[0];
    assert_eq!(exit.tgid, record.tgid);
    assert_eq!(exit.end, Some(ProcessEnd::Signaled { signal: 15, core_dumped: false }));
    assert!(exit.container_main && exit.child_pid_ns && !exit.ns_init, "{exit:?}");
    assert_ne!(exit.ns_pid, 1);
    // The sandbox's pause ends its own container, reported in its own cgroup.
    kill(pause_main.tgid, libc::SIGKILL);
    let got = exits(&mut stream, sandbox, 1, WAIT).await;
    reap(&mut pause);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].container_main && got[0].ns_init);
    assert_eq!(programs.counter(Counter::ExitsReported), 2);
}

async fn a_nested_sandbox_in_a_shared_pid_namespace_never_ends_the_container(mode: Way) {
    // shareProcessNamespace and a sandbox in the app: its init is pid 1 of a namespace two levels
    // below the host's (the pod's shared one is the first), never its container's end.
    let (mut programs, mut stream) = load(mode);
    let mut pod = Pod::new(mode, true, 27);
    let sandbox_rel = pod.add_container(28);
    let sandbox = pod.id(&sandbox_rel);
    let app = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let mut pause = pod.start(&sandbox_rel, &["sleep", "60"]);
    let pause_main = recorded_main(&programs, sandbox).await;
    let script = "unshare --pid --fork /bin/sh -c 'exit 3'; [ $? -eq 3 ] || exit 99; sleep 0.2; exit 5";
    let mut child = pod.start_shared(&pod.container_rel, pause_main.tgid, &["/bin/sh", "-c", script]);
    let record = recorded_main(&programs, app).await;
    let got = exits(&mut stream, app, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "the main process only: {got:?}");
    assert_eq!(got[0].tgid, record.tgid);
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(5)), "the sandbox ran and exited 3 first");
    assert!(got[0].container_main && !got[0].ns_init, "{:?}", got[0]);
    assert!(exits(&mut stream, app, 1, Duration::from_millis(300)).await.is_empty());
    kill(pause_main.tgid, libc::SIGKILL);
    reap(&mut pause);
}

async fn a_host_namespace_exec_in_the_container_cgroup_is_not_the_main(mode: Way) {
    // runc ≥ 1.2: `runc init` execs inside the container cgroup in the host's pid namespace
    // before the entrypoint. Here a host-namespace shell execs there first, starts the
    // container and exits 0 while the main process still runs; then the main exits 9.
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, false, 15);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", "unshare --pid --fork /bin/sh -c 'sleep 0.5; exit 9' & sleep 0.1; exit 0"]);
    let mut child = pod.cgroups.spawn_in(&pod.container_rel, &mut cmd).expect("spawn");
    let helper = child.id();
    let record = recorded_main(&programs, container).await;
    assert_ne!(record.tgid, helper);
    assert_eq!(nspid(record.tgid).last(), Some(&1));
    assert!(reap(&mut child).success(), "the helper exited first");
    let got = exits(&mut stream, container, 1, WAIT).await;
    assert_eq!(programs.counter(Counter::ExitsReported), 1, "nothing else");
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].tgid, record.tgid);
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(9)));
    assert!(got[0].container_main);
}

async fn a_fork_storm_never_reaches_user_space(mode: Way) {
    // A build or test Job: thousands of short processes (forks, and every tenth an exec).
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, true, 16);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let mark = std::env::temp_dir().join(format!("valet-storm-{}-{}", std::process::id(), mode.tag()));
    let _ = std::fs::remove_file(&mark);
    let script = format!(
        "i=0; while [ $i -lt 5000 ]; do (exit 0); if [ $((i % 10)) -eq 0 ]; then /bin/true; fi; i=$((i+1)); done; \
         : > {}; exec sleep 60",
        mark.display()
    );
    let started = Instant::now();
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", &script]);
    let record = recorded_main(&programs, container).await;
    // A hang guard only: 5,500 processes took over 120 s in an emulated 5.10 guest beside other
    // guests (load 17).
    let deadline = Instant::now() + Duration::from_secs(900);
    while !mark.exists() {
        assert!(Instant::now() < deadline, "storm did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let storm = started.elapsed();
    // Every storm process was reaped by the shell before the mark: the counts are final.
    let filtered = programs.counter(Counter::ExitsFiltered);
    eprintln!(
        "storm ({mode:?}): 5500 short processes in {storm:?}; ExitsFiltered={filtered} ExitsReported={} EventsLost={}",
        programs.counter(Counter::ExitsReported),
        programs.counter(Counter::EventsLost)
    );
    assert!(filtered >= 5500, "every storm exit counted: {filtered}");
    assert_eq!(programs.counter(Counter::ExitsReported), 0);
    assert_eq!(programs.counter(Counter::EventsLost), 0);
    assert_eq!(programs.container_main(container), Some(record), "later execs change nothing");
    // The container's end still arrives.
    kill(record.tgid, libc::SIGKILL);
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    let _ = std::fs::remove_file(&mark);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].container_main);
    assert_eq!(got[0].end, Some(ProcessEnd::Signaled { signal: 9, core_dumped: false }));
}

async fn adopted_containers_end_with_their_main_process(mode: Way) {
    // Containers that exec'd before their pod was watched (an agent restart): one with its own
    // pid namespace adopted, one with its own pid namespace not adopted, and one in a shared
    // pid namespace adopted.
    let (mut programs, mut stream) = load(mode);
    let mut pod = Pod::new(mode, false, 17);
    let own = pod.container();
    let plain_rel = pod.add_container(18);
    let plain = pod.id(&plain_rel);
    let shared_rel = pod.add_container(19);
    let shared = pod.id(&shared_rel);
    let mut own_child = pod.start(&pod.container_rel, &["sleep", "60"]);
    let mut plain_child = pod.start(&plain_rel, &["sleep", "60"]);
    let own_main = only_child(own_child.id()).await;
    let plain_main = only_child(plain_child.id()).await;
    let mut shared_child = pod.start_shared(&shared_rel, own_main, &["/bin/sh", "-c", "sleep 60; exit 0"]);
    let shared_main = only_child(shared_child.id()).await;

    let cg_dir = |rel: &str| pod.cgroups.root.join(rel);
    let found = find_container_main(Path::new("/proc"), &cg_dir(&pod.container_rel)).expect("read").expect("main");
    assert_eq!((found.tgid, found.ns_depth, found.ns_init), (own_main, 1, true));
    let found_shared = find_container_main(Path::new("/proc"), &cg_dir(&shared_rel)).expect("read").expect("main");
    assert_eq!((found_shared.tgid, found_shared.ns_init), (shared_main, false));
    assert_eq!(found_shared.pidns_inum, found.pidns_inum);
    assert_eq!(programs.record_container_main(own, &found).expect("record"), RecordOutcome::Recorded);
    assert_eq!(programs.record_container_main(own, &found).expect("record"), RecordOutcome::AlreadyRecorded);
    assert_eq!(programs.record_container_main(shared, &found_shared).expect("record"), RecordOutcome::Recorded);
    let record = programs.container_main(own).expect("record");
    assert_eq!(record.tgid, own_main);
    assert_eq!(record.flags, container_flags::ADOPTED | container_flags::NS_INIT);
    assert_eq!(record.pidns_depth, 1);
    assert!(programs.exec_seen(own) && programs.exec_seen(shared) && !programs.exec_seen(plain));
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");

    kill(shared_main, libc::SIGKILL);
    let got = exits(&mut stream, shared, 1, WAIT).await;
    reap(&mut shared_child);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].container_main && !got[0].ns_init && got[0].tgid == shared_main, "{:?}", got[0]);

    kill(own_main, libc::SIGKILL);
    let got = exits(&mut stream, own, 1, WAIT).await;
    reap(&mut own_child);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].container_main && got[0].ns_init && got[0].tgid == own_main, "{:?}", got[0]);

    // Not adopted: its pid 1 (one level below the host's) is still reported, without the
    // container_main mark; user space decides.
    kill(plain_main, libc::SIGKILL);
    let got = exits(&mut stream, plain, 1, WAIT).await;
    reap(&mut plain_child);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(!got[0].container_main && got[0].ns_init && got[0].tgid == plain_main, "{:?}", got[0]);
    assert_eq!(programs.counter(Counter::ExitsReported), 3);
}

async fn forget_container_removes_what_the_kernel_keeps(mode: Way) {
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, true, 20);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    programs.classify_exec(container, false).expect("classify");
    let mut first = pod.start(&pod.container_rel, &["/bin/sh", "-c", "exit 1"]);
    let record = recorded_main(&programs, container).await;
    reap(&mut first);
    assert!(programs.exec_seen(container));
    assert_eq!(programs.counter(Counter::Held), 0, "classified as pass");
    programs.forget_container(container);
    assert_eq!(programs.container_main(container), None);
    assert!(!programs.exec_seen(container));
    // The class is gone too: the next main process in that cgroup is recorded anew and held.
    let mut second = pod.start(&pod.container_rel, &["/bin/sh", "-c", "exit 2"]);
    let held = held(&mut stream, Some(container)).await;
    assert_eq!(held.len(), 1, "held after forget: the pass class was removed");
    let again = programs.container_main(container).expect("recorded anew");
    assert_ne!(again.tgid, record.tgid);
    assert_eq!(again.tgid, held[0].tgid);
    assert!(again.flags & container_flags::HELD != 0);
    kill(held[0].tgid, libc::SIGCONT);
    reap(&mut second);
}

async fn no_events_from_unregistered_cgroups(mode: Way) {
    let (mut programs, _stream) = load(mode);
    let watched = Pod::new(mode, true, 7);
    let other = Pod::new(mode, true, 8);
    programs.watch(watched.pod_id(), watch_flags::EXITS).expect("watch");
    for _ in 0..10 {
        let mut c = other.start(&other.container_rel, &["/bin/true"]);
        reap(&mut c);
    }
    // Processes outside any pod cgroup (this test's own children) are not reported either.
    for _ in 0..10 {
        let _ = Command::new("unshare").args(["--pid", "--fork", "/bin/true"]).status();
    }
    // All reaped: the counts are final.
    assert_eq!(programs.counter(Counter::ExitsReported), 0, "no events at all");
    assert_eq!(programs.counter(Counter::ExitsFiltered), 0, "unwatched exits are not even counted");
    assert_eq!(programs.container_main(other.container()), None);
    // And unwatching stops reporting the watched pod too.
    programs.unwatch(watched.pod_id()).expect("unwatch");
    let mut c = watched.start(&watched.container_rel, &["/bin/true"]);
    reap(&mut c);
    assert_eq!(programs.counter(Counter::ExitsReported), 0, "reported after the unwatch");
    assert_eq!(programs.counter(Counter::ExitsFiltered), 0, "counted after the unwatch");
}

async fn exec_hold_stops_the_main_process_before_it_runs(mode: Way) {
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, true, 9);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    let file = std::env::temp_dir().join(format!("valet-hold-{}-{}", std::process::id(), mode.tag()));
    let _ = std::fs::remove_file(&file);
    let script = format!("echo ran > {}; exit 4", file.display());
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", &script]);
    // The held event names the main process (not unshare, which exec'd in the host namespace).
    let held = held(&mut stream, Some(container)).await;
    let held = held.first().expect("held event").clone();
    assert_ne!(held.tgid, child.id());
    assert_eq!(nspid(held.tgid).last(), Some(&1));
    // Stopped (the signal takes effect as the exec returns, before any of its code runs).
    wait_stopped(held.tgid).await;
    assert!(!file.exists(), "the held process must not have run");
    let record = programs.container_main(container).expect("record");
    assert_eq!(record.tgid, held.tgid);
    assert_eq!(record.flags, container_flags::BY_EXEC | container_flags::NS_INIT | container_flags::HELD);
    kill(held.tgid, libc::SIGCONT);
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert!(file.exists(), "released process ran");
    let _ = std::fs::remove_file(&file);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].container_main);
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(4)));
    assert_eq!(programs.counter(Counter::Held), 1);
}

async fn exec_hold_stops_a_shared_namespace_main_too(mode: Way) {
    // The first exec deeper than the host's namespace is held even when it is not pid 1; the
    // runtime's exec in the host namespace (nsenter) is not.
    let (mut programs, mut stream) = load(mode);
    let mut pod = Pod::new(mode, false, 21);
    let sandbox_rel = pod.add_container(22);
    let sandbox = pod.id(&sandbox_rel);
    let app = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    programs.classify_exec(sandbox, false).expect("classify");
    let mut pause = pod.start(&sandbox_rel, &["sleep", "60"]);
    let pause_main = recorded_main(&programs, sandbox).await;
    let mut child = pod.start_shared(&pod.container_rel, pause_main.tgid, &["/bin/sh", "-c", "exit 8"]);
    let held = held(&mut stream, None).await;
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0].cgroup_id, app, "the sandbox was classified pass");
    assert_ne!(nspid(held[0].tgid).last(), Some(&1));
    kill(held[0].tgid, libc::SIGCONT);
    let got = exits(&mut stream, app, 1, WAIT).await;
    reap_nsenter(&mut child);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(8)));
    assert!(got[0].container_main && !got[0].ns_init);
    kill(pause_main.tgid, libc::SIGKILL);
    reap(&mut pause);
}

/// Starts `valet-test-listen` in `rel` of `pod`; returns it and the port it listens on.
fn start_listener(pod: &Pod, rel: &str) -> (Child, u16) {
    use std::io::BufRead as _;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_valet-test-listen"));
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    let mut child = pod.cgroups.spawn_in(rel, &mut cmd).expect("spawn listener");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("port");
    (child, line.trim().parse().expect("a port"))
}

async fn a_listening_socket_in_a_held_pod_is_reported(mode: Way) {
    let (mut programs, mut stream) = load(mode);
    let held = Pod::new(mode, true, 31);
    let plain = Pod::new(mode, false, 32);
    // Attached from the load on, but the pod is not watched for holds yet: nothing is reported
    // (the counter is exact: the port is printed after listen()).
    let (mut before, _) = start_listener(&held, &held.container_rel);
    assert_eq!(programs.counter(Counter::Listens), 0, "reported before the pod held");
    programs.watch(held.pod_id(), watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    programs.watch(plain.pod_id(), watch_flags::EXITS).expect("watch");
    // The listeners are sidecars, never held; they exec in the host's namespace anyway.
    programs.classify_exec(held.container(), false).expect("classify");
    // A pod watched without holds, then a process of no pod: neither is reported. Each listens
    // before the held pod's does, so its event would come first.
    let (mut quiet, _) = start_listener(&plain, &plain.container_rel);
    let mut outside = Command::new(env!("CARGO_BIN_EXE_valet-test-listen"));
    let mut outside =
        outside.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().expect("spawn");
    let mut port_line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(outside.stdout.take().expect("stdout")), &mut port_line)
        .expect("port");
    let (mut proxy, port) = start_listener(&held, &held.container_rel);
    // Connections change socket states too (SYN_SENT, ESTABLISHED): not listens.
    let _client = std::net::TcpStream::connect(("127.0.0.1", port));
    let got = collect(&mut stream, 1, WAIT, |e| match e {
        Event::Listen(l) => Some(l),
        _ => None,
    })
    .await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].port, got[0].cgroup_id, got[0].watched_cgroup_id), (port, held.container(), held.pod_id()));
    assert_eq!(got[0].tgid, proxy.id());
    for child in [&mut before, &mut quiet, &mut outside, &mut proxy] {
        drop(child.stdin.take());
        assert!(child.wait().expect("wait").success());
    }
    assert_eq!(programs.counter(Counter::Listens), 1, "one listen reported");
}

async fn exec_hold_skips_cgroups_classified_as_pass(mode: Way) {
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, false, 10);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    programs.classify_exec(container, false).expect("classify");
    // A held process would stay stopped: reap gives up (and fails) at its hang guard.
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", "exit 0"]);
    let status = reap(&mut child);
    assert!(status.success());
    let got = exits(&mut stream, container, 1, WAIT).await;
    assert!(got.iter().any(|e| e.container_main), "ran to completion: {got:?}");
    assert_eq!(programs.counter(Counter::Held), 0);
}

async fn a_full_containers_map_is_counted_and_never_holds(mode: Way) {
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, true, 23);
    let container = pod.container();
    let n = fill_containers_map(&mut programs);
    assert_eq!(n, u64::from(valet_common::CONTAINERS_CAPACITY));
    programs.watch(pod.pod_id(), watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    // No record, so no hold (a hold no one knows of would never be released); the exit of the
    // container namespace's pid 1 is still reported, without the container_main mark.
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", "exit 6"]);
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].ns_init && !got[0].container_main, "{:?}", got[0]);
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(6)));
    assert_eq!(programs.counter(Counter::MapFull), 1);
    assert_eq!(programs.counter(Counter::Held), 0);
    assert_eq!(programs.container_main(container), None);
    // Room again: the next container is recorded.
    programs.forget_container(u64::MAX);
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", "exit 0"]);
    let held = held(&mut stream, Some(container)).await;
    assert_eq!(held.len(), 1);
    kill(held[0].tgid, libc::SIGCONT);
    reap(&mut child);
}

async fn on_a_kind_node_the_host_namespace_is_the_nodes(mode: Way) {
    // On kind/k3d nodes the node is itself a container: the agent's pid namespace (hostPID) is
    // one level below the kernel's first, and containers two. A pid namespace made here plays
    // the node; the runtime runs in it (nsenter, then unshare), so its execs are the host's.
    let mut node = Command::new("unshare").args(["--pid", "--fork", "sleep", "60"]).spawn().expect("node");
    let node_init = only_child(node.id()).await;
    let (mut programs, mut stream) = load_with(mode, Some(node_init));
    let pod = Pod::new(mode, false, 24);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let script = "unshare --user --map-root-user --pid --fork /bin/sh -c 'exit 4'; [ $? -eq 4 ] || exit 99; \
                  /bin/true; sleep 0.5; exit 3";
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--pid=/proc/{node_init}/ns/pid"))
        .args(["--", "unshare", "--pid", "--fork", "/bin/sh", "-c", script]);
    let mut child = pod.cgroups.spawn_in(&pod.container_rel, &mut cmd).expect("spawn");
    let record = recorded_main(&programs, container).await;
    assert_eq!(record.pidns_depth, 1, "one level below the node's namespace");
    // The record names the main process by its pid in the node's namespace.
    let procs = std::fs::read_to_string(pod.cgroups.root.join(&pod.container_rel).join("cgroup.procs")).expect("procs");
    let main = procs.lines().filter_map(|l| l.parse::<u32>().ok()).map(nspid_or_empty).find(|ns| ns.len() == 3);
    let main = main.expect("a process two levels down");
    assert_eq!((main[1], main[2]), (record.tgid, 1), "{main:?}");
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "the main process only: {got:?}");
    assert_eq!(programs.counter(Counter::ExitsReported), 1, "nothing else");
    let exit = &got[0];
    assert_eq!(exit.end, Some(ProcessEnd::Exited(3)), "the nested init ran and exited 4 first");
    assert!(exit.container_main && exit.ns_init && exit.child_pid_ns, "{exit:?}");
    assert_eq!((exit.tgid, exit.ns_pid), (record.tgid, 1));
    kill(node_init, libc::SIGKILL);
    reap(&mut node);
}

async fn crun_runs_the_container_one_level_below_its_scope(mode: Way) {
    // crun (systemd driver) puts a container's processes in `<scope>/container` and leaves the
    // scope empty: still the container, for its hold, its record and its end.
    let (mut programs, mut stream) = load(mode);
    let mut pod = Pod::new(mode, true, 24);
    let container = pod.container();
    let leaf = format!("{}/container", pod.container_rel);
    pod.cgroups.create(&leaf).expect("crun's cgroup");
    let leaf_id = pod.id(&leaf);
    programs.watch(pod.pod_id(), watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    let mut child = pod.start(&leaf, &["/bin/sh", "-c", "exit 6"]);
    let held = held(&mut stream, None).await;
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!((held[0].cgroup_id, held[0].watched_cgroup_id), (container, pod.pod_id()), "named by its scope");
    let record = programs.container_main(container).expect("recorded under the scope");
    assert_eq!(record.tgid, held[0].tgid);
    assert!(record.flags & container_flags::HELD != 0);
    assert_eq!(programs.container_main(leaf_id), None, "never under crun's own cgroup");
    kill(held[0].tgid, libc::SIGCONT);
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].container_main && got[0].ns_init, "{:?}", got[0]);
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(6)));
}

async fn a_nested_runtimes_cgroups_are_its_container_and_its_main_may_move_there(mode: Way) {
    // dind, podman or buildah in a CI runner: the container's main process makes cgroups of its
    // own under the container's and runs nested containers there (a pid namespace one level
    // deeper), then moves itself into one (as dind's entrypoint does to delegate controllers).
    let (mut programs, mut stream) = load(mode);
    let mut pod = Pod::new(mode, false, 25);
    let container = pod.container();
    let subs: Vec<String> =
        (0..8u8).map(|i| format!("{}/docker/{}", pod.container_rel, container_id(100 + i))).collect();
    let init = format!("{}/init", pod.container_rel);
    let mut abs = Vec::new();
    for rel in subs.iter().chain([&init]) {
        abs.push(pod.cgroups.create(rel).expect("nested cgroup").display().to_string());
    }
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let (init_abs, sub_abs) = abs.split_last().expect("init");
    let nested: String = sub_abs
        .iter()
        .map(|d| format!("/bin/sh -c 'echo $$ > {d}/cgroup.procs && exec unshare --pid --fork /bin/true' || exit 90; "))
        .collect();
    let script = format!("{nested}echo $$ > {init_abs}/cgroup.procs || exit 91; /bin/true; sleep 0.1; exit 7");
    let mut child = pod.start(&pod.container_rel, &["/bin/sh", "-c", &script]);
    let record = recorded_main(&programs, container).await;
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "the main process only: {got:?}");
    assert_eq!(got[0].end, Some(ProcessEnd::Exited(7)), "it ran every nested container and moved");
    assert_eq!(got[0].tgid, record.tgid);
    assert!(got[0].container_main, "{:?}", got[0]);
    assert!(exits(&mut stream, container, 1, Duration::from_millis(300)).await.is_empty());
    for rel in subs.iter().chain([&init]) {
        let id = pod.id(rel);
        assert_eq!(programs.container_main(id), None, "{rel}: no record of its own");
        assert!(!programs.exec_seen(id), "{rel}");
    }
    assert!(programs.counter(Counter::ExitsFiltered) >= 8, "the nested inits");
}

async fn a_host_pid_pod_watched_without_flags_records_and_reports_nothing(mode: Way) {
    // A hostPID pod's container runs in the host's pid namespace, so the pid 1 of a sandbox it
    // makes (`unshare -p`, Chromium) sits right below it, where a container's init would. The
    // agent watches such a pod with neither flag and takes its ends from the API.
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, true, 26);
    let container = pod.container();
    let script = "unshare --pid --fork /bin/sh -c 'exit 3'; [ $? -eq 3 ] || exit 99; exit 0";
    programs.watch(pod.pod_id(), 0).expect("watch");
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", script]);
    let mut child = pod.cgroups.spawn_in(&pod.container_rel, &mut cmd).expect("spawn");
    assert!(reap(&mut child).success(), "the sandbox ran and exited 3");
    assert_eq!(programs.container_main(container), None);
    assert!(exits(&mut stream, container, 1, Duration::from_millis(300)).await.is_empty());
    assert_eq!(programs.counter(Counter::ExitsReported), 0);
    // What the flags keep out: reported, the sandbox's end would look like the container's.
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", script]);
    let mut child = pod.cgroups.spawn_in(&pod.container_rel, &mut cmd).expect("spawn");
    let got = exits(&mut stream, container, 1, WAIT).await;
    assert!(reap(&mut child).success());
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].ns_init && got[0].end == Some(ProcessEnd::Exited(3)), "{:?}", got[0]);
}

macro_rules! in_modes {
    ($module:ident, $way:expr, $doc:literal, $($name:ident),* $(,)?) => {
        #[doc = $doc]
        mod $module {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name($way).await;
                }
            )*
        }
    };
}

macro_rules! in_both_modes {
    ($($name:ident),* $(,)?) => {
        in_modes!(helper, super::Way::HELPER, "With `bpf_get_current_ancestor_cgroup_id` (5.11+).", $($name),*);
        in_modes!(walk, super::Way::WALK, "With the walk up `cgroup->kn->parent` (5.10).", $($name),*);
    };
}

in_both_modes!(
    exit_zero_systemd_layout,
    exit_42_cgroupfs_layout,
    killed_by_sigkill_from_the_host,
    multithreaded_main_reports_once_when_workers_exit_first,
    multithreaded_main_reports_once_when_the_leader_exits_first,
    pid_namespace_init_is_the_container_end_and_children_are_not,
    a_nested_sandbox_init_never_ends_the_container,
    shared_pid_namespace_main_is_not_pid_1_and_still_ends_its_container,
    a_host_namespace_exec_in_the_container_cgroup_is_not_the_main,
    a_fork_storm_never_reaches_user_space,
    adopted_containers_end_with_their_main_process,
    forget_container_removes_what_the_kernel_keeps,
    no_events_from_unregistered_cgroups,
    exec_hold_stops_the_main_process_before_it_runs,
    exec_hold_stops_a_shared_namespace_main_too,
    exec_hold_skips_cgroups_classified_as_pass,
    a_listening_socket_in_a_held_pod_is_reported,
    a_full_containers_map_is_counted_and_never_holds,
    on_a_kind_node_the_host_namespace_is_the_nodes,
    crun_runs_the_container_one_level_below_its_scope,
    a_nested_runtimes_cgroups_are_its_container_and_its_main_may_move_there,
    a_host_pid_pod_watched_without_flags_records_and_reports_nothing,
    a_nested_sandbox_in_a_shared_pid_namespace_never_ends_the_container,
);

// On a cgroup v1 or hybrid node: the scenarios that tell containers, pods and their ends
// apart, and the hold, with every cgroup in a v1 controller's hierarchy.
in_modes!(
    v1,
    super::Way::V1,
    "With the walk up a cgroup v1 hierarchy (pids), as on v1 and hybrid nodes.",
    exit_zero_systemd_layout,
    exit_42_cgroupfs_layout,
    pid_namespace_init_is_the_container_end_and_children_are_not,
    a_nested_sandbox_init_never_ends_the_container,
    shared_pid_namespace_main_is_not_pid_1_and_still_ends_its_container,
    a_host_namespace_exec_in_the_container_cgroup_is_not_the_main,
    a_fork_storm_never_reaches_user_space,
    adopted_containers_end_with_their_main_process,
    no_events_from_unregistered_cgroups,
    exec_hold_stops_the_main_process_before_it_runs,
    exec_hold_skips_cgroups_classified_as_pass,
    a_listening_socket_in_a_held_pod_is_reported,
    a_nested_runtimes_cgroups_are_its_container_and_its_main_may_move_there,
);

#[tokio::test]
async fn auto_uses_the_helper_where_the_kernel_allows_it() {
    require_root();
    let programs = Programs::load(Path::new("/"), Attach::default()).expect("load programs");
    if kernel_allows_the_helper() {
        assert_eq!(programs.ancestor_mode(), AncestorMode::Helper);
        assert_eq!(
            programs.attached(),
            vec![valet_common::PROG_EXIT, valet_common::PROG_EXEC, valet_common::PROG_LISTEN]
        );
        assert_eq!(programs.listen_program(), Some(valet_common::PROG_LISTEN));
    } else {
        assert_eq!(programs.ancestor_mode(), AncestorMode::Walk);
        assert_eq!(
            programs.attached(),
            vec![valet_common::PROG_EXIT_WALK, valet_common::PROG_EXEC_WALK, valet_common::PROG_LISTEN_WALK]
        );
        assert_eq!(programs.listen_program(), Some(valet_common::PROG_LISTEN_WALK));
    }
    // The listen program is attached at load, with the others, for the agent's life.
    let walk = Programs::load(Path::new("/"), Attach { ancestors: AncestorMode::Walk, ..Attach::default() })
        .expect("load walk programs");
    assert_eq!(
        walk.attached(),
        vec![valet_common::PROG_EXIT_WALK, valet_common::PROG_EXEC_WALK, valet_common::PROG_LISTEN_WALK]
    );
}
