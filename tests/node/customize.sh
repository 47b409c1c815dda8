#!/bin/sh
# Turns a Debian root file system (mmdebstrap: bookworm, trixie or sid) into a kubeadm-style node
# for the real-node VM: containerd's CRI plugin with the systemd cgroup driver, CNI bridge
# networking, a pause image of our own, AppArmor, a unit that sets the cell's OCI runtime and
# containerd layout from the kernel command line before containerd starts (valet-node-config),
# and one that runs the command named there (valet.run=<path under the host root>) once
# containerd is up, then powers off.
set -eu
R="$1"
mkdir -p "$R/host" "$R/etc/containerd" "$R/etc/cni/net.d" "$R/etc/systemd/system/multi-user.target.wants" "$R/opt/cni"
# containerd 1.6/1.7 print a `version = 2` config, 2.x a `version = 3` one (other plugin names,
# single quotes): the edits below match both, and each is checked to have taken exactly once.
C="$R/etc/containerd/config.toml"
chroot "$R" containerd config default > "$C"
sed -i \
  -e 's/SystemdCgroup = false/SystemdCgroup = true/' \
  -e 's#sandbox_image = .*#sandbox_image = "docker.io/valet/pause:1"#' \
  -e "s#^\( *\)sandbox = .*#\\1sandbox = 'docker.io/valet/pause:1'#" \
  "$C"
once() { n=$(grep -c "$1" "$C" || true); [ "$n" = 1 ] || { echo "customize.sh: $C has $n lines matching $1, not 1" >&2; exit 1; }; }
once 'SystemdCgroup = true'
once 'valet/pause:1'
once 'BinaryName = '
once "^root = ['\"]/var/lib/containerd['\"]"
once "^state = ['\"]/run/containerd['\"]"
once "address = ['\"]/run/containerd/containerd.sock['\"]"
# Debian's CNI plugins are in /usr/lib/cni; containerd looks in /opt/cni/bin by default.
ln -sfn /usr/lib/cni "$R/opt/cni/bin"
cat > "$R/etc/cni/net.d/10-valet.conflist" <<'CNI'
{
  "cniVersion": "1.0.0",
  "name": "valet-pods",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
CNI
cat > "$R/usr/local/sbin/valet-node-run" <<'RUN'
#!/bin/sh
# Runs the command the host named on the kernel command line, then powers the VM off.
run=$(sed -n 's/.*valet\.run=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$run" ]; then
  echo "VALET-NODE-READY $(cut -d' ' -f1 /proc/uptime)"
  sh "/host$run" > /dev/console 2>&1
  echo "VALET-NODE-EXIT $?" > /dev/console
  sync
  systemctl --force poweroff
fi
RUN
chmod 755 "$R/usr/local/sbin/valet-node-run"
cat > "$R/usr/local/sbin/valet-node-config" <<'CONFIG'
#!/bin/sh
# The cell's OCI runtime (valet.runtime=runc|crun) and containerd layout (valet.layout=kubeadm|k3s)
# from the kernel command line, written into containerd's config before containerd starts. The
# runtime handler keeps its name (runc) with crun as its binary; k3s keeps containerd's root in
# /var/lib/rancher/k3s/agent/containerd, its state and socket in /run/k3s/containerd.
set -eu
arg() { sed -n "s/.*valet\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
C=/etc/containerd/config.toml
case "$(arg runtime)" in
  ""|runc) ;;
  crun) sed -i "s#BinaryName = .*#BinaryName = '/usr/bin/crun'#" "$C" ;;
  *) echo "valet-node-config: unknown runtime $(arg runtime)" > /dev/console; exit 1 ;;
esac
case "$(arg layout)" in
  ""|kubeadm) ;;
  k3s) sed -i -e 's#/var/lib/containerd#/var/lib/rancher/k3s/agent/containerd#g' -e 's#/run/containerd#/run/k3s/containerd#g' "$C" ;;
  *) echo "valet-node-config: unknown layout $(arg layout)" > /dev/console; exit 1 ;;
esac
CONFIG
chmod 755 "$R/usr/local/sbin/valet-node-config"
cat > "$R/etc/systemd/system/valet-node-config.service" <<'UNIT'
[Unit]
Description=Set the cell's OCI runtime and containerd layout
Before=containerd.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/valet-node-config
StandardOutput=journal+console

[Install]
WantedBy=multi-user.target containerd.service
UNIT
ln -sf /etc/systemd/system/valet-node-config.service "$R/etc/systemd/system/multi-user.target.wants/valet-node-config.service"
mkdir -p "$R/etc/systemd/system/containerd.service.wants"
ln -sf /etc/systemd/system/valet-node-config.service "$R/etc/systemd/system/containerd.service.wants/valet-node-config.service"
cat > "$R/etc/systemd/system/valet-node-run.service" <<'UNIT'
[Unit]
Description=Run the host's test command on this node
After=containerd.service
Requires=containerd.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/valet-node-run
StandardOutput=journal+console

[Install]
WantedBy=multi-user.target
UNIT
ln -sf /etc/systemd/system/valet-node-run.service "$R/etc/systemd/system/multi-user.target.wants/valet-node-run.service"
echo valet-node > "$R/etc/hostname"
# No getty on the serial console: the console carries the test output.
ln -sf /dev/null "$R/etc/systemd/system/serial-getty@ttyS0.service"
ln -sf /dev/null "$R/etc/systemd/system/getty@tty1.service"
