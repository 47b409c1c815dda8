#!/usr/bin/env python3
"""Builds a one-layer OCI image without a registry or Docker: an OCI image layout, in a tar (for
`ctr -n k8s.io images import`) or, with --layout, as a directory as well. Reproducible: every
timestamp is 0, so the same inputs give the same digests.

    oci_image.py OUT.tar NAME --add SRC:DST [--add SRC:DST ...] [--elf SRC:DST] [--link DST:TARGET]
                 [--entrypoint JSON] [--env K=V] [--label K=V] [--user U] [--port P/tcp] [--layout DIR]
                 [--arch amd64|arm64 --sysroot DIR]
    oci_image.py OUT.tar NAME --index LAYOUT [--index LAYOUT ...] [--layout DIR]

--elf copies a dynamically linked executable together with the shared libraries it needs, so
host-built binaries run in the image: `ldd` names them for the host's architecture; for another
(--arch, a cross-built binary) they are the ELF's NEEDED entries and its interpreter, found in
--sysroot (Debian's cross sysroot, /usr/aarch64-linux-gnu) and placed where Debian's loader of
that architecture looks.

--index makes one multi-platform image of single-platform layouts built before: an image index
naming each manifest with its platform (from its config), the blobs of all.
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


# Debian's paths for an architecture: the ELF interpreter's and the libraries' directory.
MULTIARCH = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}


def elf_needs(path):
    """(interpreter, [NEEDED sonames]) of an ELF file, read with readelf (any architecture)."""
    interp, needed = None, []
    headers = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True, check=True).stdout
    for line in headers.splitlines():
        if "Requesting program interpreter:" in line:
            interp = line.split("interpreter:", 1)[1].strip().rstrip("]").strip()
    dynamic = subprocess.run(["readelf", "-dW", path], capture_output=True, text=True, check=True).stdout
    for line in dynamic.splitlines():
        if "(NEEDED)" in line and "[" in line:
            needed.append(line.rsplit("[", 1)[1].rstrip("]"))
    return interp, needed


def foreign_libraries(path, arch, sysroot):
    """[(source in the sysroot, path in the image)] of what a cross-built ELF loads, transitively."""
    libdir = f"/lib/{MULTIARCH[arch]}"
    found, todo, seen = [], [path], set()
    interp, _ = elf_needs(path)
    if interp:
        src = os.path.join(sysroot, "lib", os.path.basename(interp))
        if not os.path.exists(src):
            raise SystemExit(f"{path}: interpreter {interp} is not in {sysroot}/lib")
        found.append((src, interp))
    while todo:
        for soname in elf_needs(todo.pop())[1]:
            if soname in seen:
                continue
            seen.add(soname)
            dirs = [os.path.join(sysroot, d) for d in ("lib", f"lib/{MULTIARCH[arch]}", f"usr/lib/{MULTIARCH[arch]}")]
            src = next((os.path.join(d, soname) for d in dirs if os.path.exists(os.path.join(d, soname))), None)
            if src is None:
                raise SystemExit(f"{path}: {soname} is in none of {dirs}")
            found.append((src, f"{libdir}/{soname}"))
            todo.append(os.path.realpath(src))
    return found


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
    p.add_argument("--arch", default="amd64", choices=sorted(MULTIARCH))
    p.add_argument("--sysroot", help="where --elf's libraries are for an --arch not the host's")
    p.add_argument("--index", action="append", default=[], help="a single-platform layout to merge")
    a = p.parse_args()
    files = {}
    if a.index:
        write(a, files, merge(files, a.index, a.name), "index")
        return

    buf = io.BytesIO()
    seen = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as layer:
        for spec in a.add + a.elf:
            src, dst = spec.split(":", 1)
            add_file(layer, seen, src, dst)
        for spec in a.elf:
            src = spec.split(":", 1)[0]
            if a.sysroot:
                for lib_src, lib_dst in foreign_libraries(src, a.arch, a.sysroot):
                    add_file(layer, seen, os.path.realpath(lib_src), lib_dst, 0o755)
            else:
                for lib in shared_libraries(src):
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
        "architecture": a.arch,
        **({"variant": "v8"} if a.arch == "arm64" else {}),
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
    top = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest_desc}
    write(a, files, top, f"manifest {manifest_desc['digest']}, layer {layer_desc['size']} bytes")


def merge(files, layouts, name):
    """Copies each single-platform layout's blobs into `files` and returns the descriptor of an
    image index over their manifests, each with its platform."""
    manifests = []
    for layout in layouts:
        index = json.load(open(os.path.join(layout, "index.json")))
        for desc in index["manifests"]:
            blobs = os.path.join(layout, "blobs", "sha256")
            for digest in os.listdir(blobs):
                files[f"blobs/sha256/{digest}"] = open(os.path.join(blobs, digest), "rb").read()
            manifest = json.loads(files["blobs/sha256/" + desc["digest"].split(":", 1)[1]])
            config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].split(":", 1)[1]])
            platform = {"architecture": config["architecture"], "os": config["os"]}
            if "variant" in config:
                platform["variant"] = config["variant"]
            manifests.append({"mediaType": desc["mediaType"], "digest": desc["digest"], "size": desc["size"],
                              "platform": platform})
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests}
    desc = blob(files, json.dumps(index).encode())
    platforms = ", ".join(f"{m['platform']['os']}/{m['platform']['architecture']}" for m in manifests)
    print(f"{name}: index {desc['digest']} of {platforms}")
    return {"mediaType": "application/vnd.oci.image.index.v1+json", **desc}


def write(a, files, top, what):
    """Writes the layout (index.json naming `top` as image `a.name`) to the tar and --layout."""
    index = {
        "schemaVersion": 2,
        "manifests": [{
            **top,
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
    print(f"{a.name}: {what}")


if __name__ == "__main__":
    main()
