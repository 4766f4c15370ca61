"""Packaging metadata (issue 11): a licence file matching the SPDX licence, py.typed
in every package, project URLs, and a README whose links work on a package index
(absolute, under the project's Homepage). One test builds the wheel."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]


def _readme_links() -> list[str]:
    text = (ROOT / "README.md").read_text()
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)", text)  # [text](target) and ![alt](target)
    reference = re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?\s*$", text, re.M)  # [label]: target
    html = re.findall(r"""(?:href|src)\s*=\s*["']([^"']+)""", text)
    return inline + reference + html


def test_readme_links_are_absolute_and_under_the_homepage():
    links = _readme_links()
    assert links, "the README links to the docs"
    relative = [link for link in links if not re.match(r"^(https?://|mailto:|#)", link)]
    assert relative == [], f"relative links break on a package index: {relative}"
    home = PROJECT["urls"]["Homepage"].rstrip("/")
    ours = [link for link in links if "damcha-project" in link or "/docs/" in link]
    assert ours and all(link.startswith(home + "/") for link in ours), ours
    for link in ours:  # each link names a file that exists in this repository
        path = re.sub(rf"^{re.escape(home)}/(blob|tree)/main/", "", link).split("#")[0]
        assert (ROOT / path).exists(), link


def test_license_urls_and_typed_packages_are_declared():
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert PROJECT["license-files"] == ["LICENSE"]
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in licence
    (requirement,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.search(r">=\s*(\d+)", requirement).group(1)) >= 77  # PEP 639 license fields
    home = PROJECT["urls"]["Homepage"]
    assert set(PROJECT["urls"]) == {"Homepage", "Documentation", "Source", "Issues"}
    assert all(url.startswith(home) for url in PROJECT["urls"].values())
    package_data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package, folder in PACKAGE_DIRS.items():
        assert (ROOT / folder / "py.typed").is_file(), package
        assert "py.typed" in package_data.get(package, []), package


def test_wheel_holds_the_license_and_py_typed(tmp_path):
    """Builds the wheel offline from a copy of the sources (the setuptools of this
    environment, no network, nothing written into the checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in set(PACKAGE_DIRS.values()):
        # Without the kernel this checkout built in place: the wheel must compile its own.
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("damcha-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert {f"{p}/py.typed" for p in PACKAGE_DIRS} <= set(names)
    # The decoding kernel (setup.py), compiled for this platform, with its stub.
    assert [n for n in names if n.startswith("damcha_torch/_headmix.") and n.endswith((".so", ".pyd"))], names
    assert "damcha_torch/_headmix.pyi" in names and "damcha_torch/_headmix.c" not in names, names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Project-URL: Homepage, {PROJECT['urls']['Homepage']}" in metadata
