"""What the kubelet and containerd's CRI do with the agent's pod before and while its containers run,
for the fields deploy/base/daemonset.yaml uses: the node VM's DaemonSet runner
(scenarios.py's ContainerAgent, from daemonset_cri.py's translation) applies these rules, and
deploy/tests/test_node_runner.py checks each one against a fake host root. No YAML here: the node
VM imports this file with its bare python3.

The rules, each from the code that makes it (kubernetes/kubernetes, containerd/containerd):

- hostPath `type` (`check_host_path`): pkg/volume/hostpath/host_path.go, `hostPathMounter.SetUp`
  returns at once for an unset type (`HostPathUnset`: no check at all), else `checkType`:
  `DirectoryOrCreate` and `FileOrCreate` create what does not exist (`makeDir`: os.MkdirAll with
  0755, an existing path is no error; `makeFile`: open O_CREATE 0644) and check the type of what
  exists (`fallthrough` to `Directory`/`File`); `Directory`, `File`, `Socket`, `CharDevice`,
  `BlockDevice` require the path to exist (`typeMatchedOrError`: "hostPath %s doesn't exist") with
  that type, found by stat(2) following symlinks (pkg/kubelet/.../hostutil_linux.go
  `GetFileType`); any other value is "an invalid volume type". The kubelet mounts (sets up) every
  volume of the pod before it creates the sandbox (pkg/kubelet/kubelet.go `SyncPod`:
  `WaitForAttachAndMount`), so one failed check keeps the whole pod in ContainerCreating.
- a hostPath whose source is missing when the type is unset (`runtime_source`): containerd's CRI
  creates it as a directory, 0755, before the bind mount (internal/cri/opts/spec_linux_opts.go
  `withMounts`: "Create the host path if it doesn't exist", osi.Stat then osi.MkdirAll(src,
  0755); the same in 1.6/1.7's pkg/cri/server/container_create_linux.go `WithMounts`); a stat
  error other than ENOENT, or a mkdir that fails (e.g. in sysfs), fails CreateContainer.
- `readOnly` and `recursiveReadOnly` (`resolve_rro`): the API server refuses recursiveReadOnly
  `Enabled`/`IfPossible` without `readOnly: true` or with a mountPropagation other than None
  (pkg/apis/core/validation/validation.go `validateMountRecursiveReadOnly`); the kubelet turns
  `IfPossible` into a recursive read-only mount when the runtime handler reports
  `RecursiveReadOnlyMounts` and into a plain read-only one otherwise, and refuses the container
  (CreateContainerConfigError, "requested recursive read-only mode, but it is not supported by
  the runtime") for `Enabled` on a runtime that does not report it (pkg/kubelet/kubelet_pods.go
  `makeMounts`); containerd then asks runc for `rro` (mount_setattr(AT_RECURSIVE)), else `ro`, which
  runc applies to the top mount only: the mounts below a hostPath (it is bound `rbind`) stay
  writable (spec_linux_opts.go `withMounts`).
- liveness (`Liveness`): pkg/kubelet/prober/worker.go: a probe every periodSeconds, each
  with its timeoutSeconds; `failureThreshold` consecutive failures make the result Failure, one
  success resets the count; a liveness Failure kills the container (with the pod's grace period)
  and, restartPolicy Always, starts it again (pkg/kubelet/kuberuntime/kuberuntime_manager.go
  `computePodActions`: "Container ... failed liveness probe, will be restarted"). An HTTP probe
  succeeds on a status from 200 to 399 (pkg/probe/http/http.go `DoHTTPProbe`).

The rules that are plain translations (capabilities, seccomp, AppArmor, resources, env) are in
daemonset_cri.py's header.
"""
import os
import stat

HOST_PATH_TYPES = ("", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
                   "BlockDevice")


class PodWouldNotStart(Exception):
    """The kubelet or the runtime would keep the pod (or a container) from starting, and why."""


def host(root, path):
    """`path` of the node, under `root` (a fake host root in the tests, "" on the node)."""
    return os.path.join(root, path.lstrip("/")) if root else path


def file_type(path):
    """hostutil's GetFileType: stat(2) following symlinks."""
    mode = os.stat(path).st_mode
    for test, name in ((stat.S_ISSOCK, "Socket"), (stat.S_ISBLK, "BlockDevice"), (stat.S_ISCHR, "CharDevice"),
                       (stat.S_ISDIR, "Directory"), (stat.S_ISREG, "File")):
        if test(mode):
            return name
    raise PodWouldNotStart(f"only recognise file, directory, socket, block device and character device ({path})")


def exists(path):
    """host_path.go's `exists`: PathExists with no error (a broken symlink does not exist)."""
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def check_host_path(path, kind, root=""):
    """The kubelet's hostPath type check of the node's `path`: None when it passes (creating what
    the type says to create), else PodWouldNotStart with the kubelet's message."""
    kind = kind or ""
    if kind not in HOST_PATH_TYPES:
        raise PodWouldNotStart(f"{kind} is an invalid volume type")
    if kind == "":
        return None
    p = host(root, path)
    described = {"Directory": "directory", "File": "file", "Socket": "socket file", "CharDevice": "character device",
                 "BlockDevice": "block device"}
    if kind == "DirectoryOrCreate":
        if not exists(p):
            try:
                os.makedirs(p, 0o755, exist_ok=True)
            except OSError as e:
                raise PodWouldNotStart(f"mkdir {path}: {e.strerror}") from e
            return None
        kind = "Directory"
    elif kind == "FileOrCreate":
        if not exists(p):
            try:
                os.close(os.open(p, os.O_CREAT | os.O_RDONLY, 0o644))
            except OSError as e:
                raise PodWouldNotStart(f"open {path}: {e.strerror}") from e
            return None
        kind = "File"
    if not exists(p):
        raise PodWouldNotStart(f"hostPath {path} doesn't exist")
    got = file_type(p)
    if got != kind:
        raise PodWouldNotStart(f"hostPath type check failed: {path} is not a {described[kind]}, it's a {got}")
    return None


def runtime_source(path, root=""):
    """containerd's CRI at CreateContainer: a missing bind source is made a directory (0755);
    PodWouldNotStart when that fails or the stat fails otherwise."""
    p = host(root, path)
    try:
        os.stat(p)
        return None
    except FileNotFoundError:
        pass
    except OSError as e:
        raise PodWouldNotStart(f"failed to stat {path!r}: {e.strerror}") from e
    try:
        os.makedirs(p, 0o755, exist_ok=True)
    except OSError as e:
        raise PodWouldNotStart(f"failed to mkdir {path!r}: {e.strerror}") from e
    return None


def start_pod(volumes, mounts, root="", rro_supported=False):
    """Everything the kubelet and the runtime check before the pod's containers run: every hostPath
    volume's type (the pod's volumes, all of them, before the sandbox), then each container's mounts
    (the runtime's missing sources, the recursive read-only resolution). `volumes`: [{name, path,
    type}]; `mounts`: {container name: [mount as daemonset_cri.py translates it]}. Returns
    {container name: [CRI mounts]}; raises PodWouldNotStart."""
    for v in volumes:
        try:
            check_host_path(v["path"], v.get("type", ""), root)
        except PodWouldNotStart as e:
            raise PodWouldNotStart(f"MountVolume.SetUp failed for volume {v['name']!r}: {e}") from e
    out = {}
    for name, ms in mounts.items():
        out[name] = []
        for m in ms:
            runtime_source(m["host_path"], root)
            rro = resolve_rro(m.get("recursive_read_only", "Disabled"), m["readonly"], rro_supported, m["volume"])
            out[name].append({"container_path": m["container_path"], "host_path": m["host_path"],
                              "readonly": m["readonly"], "recursive_read_only": rro})
    return out


def resolve_rro(mode, readonly, supported, volume="?"):
    """The kubelet's recursive read-only decision for one mount: whether the runtime is asked
    for a recursive read-only bind."""
    mode = mode or "Disabled"
    if mode == "Disabled":
        return False
    if mode not in ("IfPossible", "Enabled"):
        raise PodWouldNotStart(f"recursiveReadOnly {mode!r}: supported values are Disabled, Enabled, IfPossible")
    if not readonly:
        raise PodWouldNotStart(f"volume {volume!r}: recursiveReadOnly may only be specified when readOnly is true")
    if supported:
        return True
    if mode == "Enabled":
        raise PodWouldNotStart(f"failed to resolve recursive read-only mode: volume {volume!r} requested recursive "
                               "read-only mode, but it is not supported by the runtime")
    return False


class Liveness:
    """The kubelet's liveness worker for one container: `result(ok)` after each probe returns
    True when the container is to be restarted."""

    def __init__(self, failure_threshold=3):
        self.threshold = failure_threshold
        self.failures = 0

    def result(self, ok):
        if ok:
            self.failures = 0
            return False
        self.failures += 1
        if self.failures >= self.threshold:
            self.failures = 0
            return True
        return False
