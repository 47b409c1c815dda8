#!/usr/bin/env python3
"""Builds a one-layer OCI image without a registry or Docker: an OCI image layout, in a tar (for
`ctr -n k8s.io images import`) or, with --layout, as a directory as well. Reproducible: every
timestamp is 0, so the same inputs give the same digests.

    oci_image.py OUT.tar NAME --add SRC:DST [--add SRC:DST ...] [--elf SRC:DST] [--link DST:TARGET]
                 [--entrypoint JSON] [--env K=V] [--label K=V] [--user U] [--port P/tcp] [--layout DIR]

--elf copies a dynamically linked executable together with the shared libraries `ldd` names, so
host-built binaries run in the image.
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile


def add_file(layer, seen, src, dst, mode=None):
    dst = dst.lstrip("/")
    parts = dst.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        d = "/".join(parts[:i])
        if d not in seen:
            seen.add(d)
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            layer.addfile(info)
    if dst in seen:
        return
    seen.add(dst)
    data = open(src, "rb").read()
    info = tarfile.TarInfo(dst)
    info.size, info.mtime = len(data), 0
    info.mode = mode if mode is not None else (os.stat(src).st_mode & 0o777)
    layer.addfile(info, io.BytesIO(data))


def shared_libraries(path):
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        words = line.split()
        if "=>" in words and len(words) > words.index("=>") + 1 and words[words.index("=>") + 1].startswith("/"):
            libs.append(words[words.index("=>") + 1])
        elif words and words[0].startswith("/"):
            libs.append(words[0])
    return libs


def blob(files, data):
    digest = hashlib.sha256(data).hexdigest()
    files[f"blobs/sha256/{digest}"] = data
    return {"digest": f"sha256:{digest}", "size": len(data)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("name", help="full reference, e.g. docker.io/valet/app:1")
    p.add_argument("--add", action="append", default=[])
    p.add_argument("--elf", action="append", default=[])
    p.add_argument("--link", action="append", default=[])
    p.add_argument("--entrypoint", default="[]")
    p.add_argument("--env", action="append", default=["PATH=/bin:/usr/bin"])
    p.add_argument("--label", action="append", default=[])
    p.add_argument("--user")
    p.add_argument("--port", action="append", default=[])
    p.add_argument("--layout", help="also write the image layout as a directory here")
    a = p.parse_args()
    files = {}

    buf = io.BytesIO()
    seen = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as layer:
        for spec in a.add + a.elf:
            src, dst = spec.split(":", 1)
            add_file(layer, seen, src, dst)
        for spec in a.elf:
            for lib in shared_libraries(spec.split(":", 1)[0]):
                add_file(layer, seen, os.path.realpath(lib), lib, 0o755)
        for spec in a.link:
            dst, target = spec.split(":", 1)
            info = tarfile.TarInfo(dst.lstrip("/"))
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 0
            layer.addfile(info)
    layer_bytes = buf.getvalue()

    layer_desc = blob(files, layer_bytes)
    image_config = {"Entrypoint": json.loads(a.entrypoint), "Env": a.env}
    if a.label:
        image_config["Labels"] = dict(kv.split("=", 1) for kv in a.label)
    if a.user:
        image_config["User"] = a.user
    if a.port:
        image_config["ExposedPorts"] = {p: {} for p in a.port}
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": image_config,
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
    }
    config_desc = blob(files, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_desc}],
    }
    manifest_desc = blob(files, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            **manifest_desc,
            "annotations": {
                "io.containerd.image.name": a.name,
                "org.opencontainers.image.ref.name": a.name.rsplit(":", 1)[-1],
            },
        }],
    }
    files["oci-layout"] = b'{"imageLayoutVersion":"1.0.0"}'
    files["index.json"] = json.dumps(index).encode()
    with tarfile.open(a.out, "w") as out:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            out.addfile(info, io.BytesIO(data))
    if a.layout:
        shutil.rmtree(a.layout, ignore_errors=True)
        for name, data in files.items():
            path = os.path.join(a.layout, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    print(f"{a.name}: manifest {manifest_desc['digest']}, layer {layer_desc['size']} bytes")


if __name__ == "__main__":
    main()
