#!/bin/sh
# Turns a Debian bookworm root file system (mmdebstrap) into a kubeadm-style node for the
# real-node VM: containerd's CRI plugin with the systemd cgroup driver, CNI bridge networking,
# a pause image of our own, and a unit that runs the command named on the kernel command line
# (valet.run=<path under the host root>) once containerd is up, then powers off.
set -eu
R="$1"
mkdir -p "$R/host" "$R/etc/containerd" "$R/etc/cni/net.d" "$R/etc/systemd/system/multi-user.target.wants"
chroot "$R" containerd config default > "$R/etc/containerd/config.toml"
sed -i \
  -e 's/SystemdCgroup = false/SystemdCgroup = true/' \
  -e 's#sandbox_image = .*#sandbox_image = "docker.io/valet/pause:1"#' \
  -e 's#bin_dir = "/opt/cni/bin"#bin_dir = "/usr/lib/cni"#' \
  "$R/etc/containerd/config.toml"
grep -q 'SystemdCgroup = true' "$R/etc/containerd/config.toml"
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
