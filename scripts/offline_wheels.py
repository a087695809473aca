"""Python wheels for an offline GPU host, shipped in parts no larger than a transfer allows.

    python -m raydecode.scripts.offline_wheels stage OUT [--python 3.12] [--part-mb 40] [--set serve]
        (sets: fla, kernels, ray, schema, serve; `--set serve --set schema`: an in-process
        OpenAI server (actors/serve.py LocalServer) and the openai client, without Ray;
        `--set fla`: the prefill kernels' fla-core)
    python -m raydecode.scripts.offline_wheels build-triton-kernels SRC OUT
        (SRC: python/triton_kernels of triton-lang/triton at TRITON_KERNELS_REF, the `ogs`
        extra's pin; OUT gets its wheel, for run_served_round.sh's EXTRA_WHEELS)
    python -m raydecode.scripts.offline_wheels install PARTDIR [--stash /root/wheel-stash]
        [--target /root/site]                       # on the host, after each part, in order

`stage` downloads the pinned wheels of the named sets for the host's Python (manylinux x86-64,
no dependencies resolved: the sets list what an air-gapped CUDA image lacks), drops Ray's Java
jar (only Java workers load it), packs them into one tar with a sha256 manifest and cuts it into
OUT/1, OUT/2, … Each `install` appends its part to the stash; once all are there it checks the
digest, installs with `pip --target` and writes TARGET/env.sh (PYTHONPATH incl. CuTe DSL's
`dsl_packages`, which `--target` installs do not add through their .pth file).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

SETS = {
    # the decode kernels (CuTe DSL)
    "kernels": ["nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
                "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1",
                "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5"],
    # the KDA prefill's fla-core (pure Python over the host's Triton; einops its declared
    # dependency, packaging one it imports undeclared)
    "fla": ["fla-core==0.6.0", "einops==0.8.2", "packaging==26.4"],
    "ray": ["ray==2.60.0"],
    # the request tools' JSON Schema check (actors/openai_api.py)
    "schema": ["jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
               "referencing==0.37.0", "rpds-py==2026.9.1", "attrs==26.1.0"],
    # Ray Serve's HTTP side, the deployment config's pydantic and the official openai client
    "serve": ["fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "pydantic==2.14.4",
              "pydantic-core==2.50.5", "annotated-types==0.8.0", "annotated-doc==0.0.7",
              "typing-inspection==0.4.5", "typing-extensions==4.16.0",
              "opentelemetry-api==1.45.2", "grpcio==1.85.1", "grpcio-reflection==1.85.1", "openai==3.57.0",
              "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.4", "jiter==0.19.0",
              "sniffio==1.3.1", "anyio==4.16.0", "click==8.5.1", "h11==0.16.0", "idna==3.20",
              "prometheus-client==0.26.0"],
}
# triton-lang/triton release/3.6.x, "[release 3.6] Release Triton to pypi" (Triton 3.6.0, the
# GPU hosts' Triton): the pyproject `ogs` extra's commit
TRITON_KERNELS_REF = "7c56a5e40f7fd928dfd5c72902d5def0097db73a"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _slim_ray(path: str) -> None:
    tmp = path + ".slim"
    with zipfile.ZipFile(path) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if not info.filename.startswith("ray/jars/"):
                zo.writestr(info, zi.read(info.filename))
    os.replace(tmp, path)


def stage(out: str, python: str, part_mb: float, sets: list[str]) -> list[str]:
    pkgs = [p for s in sets for p in SETS[s]]
    work = tempfile.mkdtemp(prefix="wheels-")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", work]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + pkgs, check=True)
    for w in glob.glob(os.path.join(work, "ray-*.whl")):
        _slim_ray(w)
    wheels = sorted(glob.glob(os.path.join(work, "*.whl")))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        manifest = "".join(f"{_sha256(w)}  {os.path.basename(w)}\n" for w in wheels)
        data = manifest.encode()
        ti = tarfile.TarInfo("MANIFEST")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
        for w in wheels:
            tar.add(w, arcname=os.path.basename(w))
    blob = buf.getvalue()
    digest = hashlib.sha256(blob).hexdigest()
    size = int(part_mb * 2**20)
    pieces = [blob[i:i + size] for i in range(0, len(blob), size)]
    os.makedirs(out, exist_ok=True)
    dirs = []
    for i, piece in enumerate(pieces, 1):
        d = os.path.join(out, str(i))
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "piece"), "wb") as f:
            f.write(piece)
        with open(os.path.join(d, "PART"), "w") as f:
            f.write(f"{i} of {len(pieces)} {digest}\n")
        dirs.append(d)
    return dirs


def build_triton_kernels(src: str, out: str) -> str:
    """The triton_kernels wheel from a source folder (no PyPI wheel exists; pure Python, no
    dependencies installed: the host's Triton is the one it runs on) -> the wheel's path."""
    if not os.path.isfile(os.path.join(src, "triton_kernels", "matmul_ogs.py")):
        raise SystemExit(f"{src}: not python/triton_kernels of triton-lang/triton (no "
                         f"triton_kernels/matmul_ogs.py); check out {TRITON_KERNELS_REF}")
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", out, src], check=True)
    return max(glob.glob(os.path.join(out, "triton_kernels-*.whl")), key=os.path.getmtime)


def install(part: str, stash: str, target: str) -> str:
    i, _, n, digest = open(os.path.join(part, "PART")).read().split()
    i, n = int(i), int(n)
    os.makedirs(stash, exist_ok=True)
    with open(os.path.join(part, "piece"), "rb") as src, \
            open(os.path.join(stash, f"piece.{i}"), "wb") as dst:
        dst.write(src.read())
    have = sorted(glob.glob(os.path.join(stash, "piece.*")))
    if len(have) < n:
        return f"staged part {i} of {n}; ship the next part"
    blob = b"".join(open(os.path.join(stash, f"piece.{k}"), "rb").read() for k in range(1, n + 1))
    if hashlib.sha256(blob).hexdigest() != digest:
        raise SystemExit(f"the {n} parts in {stash} do not make the staged tar (sha256 differs); "
                         "ship every part of one staging again")
    wdir = os.path.join(stash, "w")
    os.makedirs(wdir, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(wdir, filter="data")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", target,
                    *sorted(glob.glob(os.path.join(wdir, "*.whl")))], check=True)
    paths = [target] + glob.glob(os.path.join(target, "nvidia_cutlass_dsl", "dsl_packages"))
    with open(os.path.join(target, "env.sh"), "w") as f:
        f.write(f"export PYTHONPATH={':'.join(paths)}${{PYTHONPATH:+:$PYTHONPATH}}; "
                f"export PATH={target}/bin:$PATH\n")
    return f"installed into {target}; run: source {target}/env.sh"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("out")
    s.add_argument("--python", default="3.12")
    s.add_argument("--part-mb", type=float, default=40.0)
    s.add_argument("--set", action="append", choices=sorted(SETS), default=None,
                   help="wheel sets (repeatable; default: all)")
    i = sub.add_parser("install")
    i.add_argument("part")
    i.add_argument("--stash", default="/root/wheel-stash")
    i.add_argument("--target", default="/root/site")
    b = sub.add_parser("build-triton-kernels")
    b.add_argument("src")
    b.add_argument("out")
    args = ap.parse_args(argv)
    if args.cmd == "build-triton-kernels":
        print(build_triton_kernels(args.src, args.out))
    elif args.cmd == "stage":
        for d in stage(args.out, args.python, args.part_mb, args.set or sorted(SETS)):
            print(d, os.path.getsize(os.path.join(d, "piece")))
    else:
        print(install(args.part, args.stash, args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
