"""The sdist and wheel `python -m build` makes carry what they must.

Both carry the Apache-2.0 text (LICENSE) and declare it (License-File); the
sdist carries the whole test tree and the examples, so that `python -m pytest`
runs in an unpacked sdist. The build is isolated (pip fetches the declared
build requirements, setuptools>=77, from the package index) and runs on a copy
of the source tree, so the checkout gets no build/ or egg-info directories.
"""

import email.parser
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What an sdist must carry of these folders: every file, but no caches.
SHIPPED_TREES = ("tests", "examples")
_JUNK = re.compile(r"(^|/)(__pycache__|\.hypothesis|\.pytest_cache)(/|$)|\.py[cod]$")


def _source_files():
    """Paths (relative, '/'-separated) of the source tree: git's tracked files in
    a checkout, else (an unpacked sdist) the files on disk, without caches."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.split("\0")
        return sorted(p for p in listed if p and (ROOT / p).is_file())
    files = (p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file())
    return sorted(
        p for p in files
        if not _JUNK.search(p) and not p.startswith((".", "build/", "dist/"))
        and ".egg-info/" not in p
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Builds the sdist and the wheel (the wheel from the sdist, as `build` does)."""
    import build  # noqa: F401  (the `test` extra installs it; a clear error if missing)

    tmp = tmp_path_factory.mktemp("packaging")
    tree, out = tmp / "tree", tmp / "dist"
    for name in _source_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(tree)],
        capture_output=True, text=True, timeout=540,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(out.iterdir())
    with tarfile.open(sdists[0]) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        sdist_files = {
            name.split("/", 1)[1]: name for name in sdist.getnames()
            if "/" in name and sdist.getmember(name).isfile()
        }
        pkg_info = sdist.extractfile(f"{top}/PKG-INFO").read().decode()
        sdist_license = sdist.extractfile(f"{top}/LICENSE").read().decode()
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = wheel.read(metadata_name).decode()
        wheel_licenses = [n for n in names if re.search(r"\.dist-info/licenses/LICENSE$", n)]
        wheel_license = wheel.read(wheel_licenses[0]).decode() if wheel_licenses else ""
    return {
        "sdist_files": sdist_files,
        "pkg_info": pkg_info,
        "sdist_license": sdist_license,
        "metadata": metadata,
        "wheel_license": wheel_license,
    }


def _headers(text, name):
    return email.parser.Parser().parsestr(text).get_all(name) or []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_license_text_in_both_artifacts(built):
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the whole text, not a notice
    assert built["sdist_license"] == license_text
    assert built["wheel_license"] == license_text
    for metadata in (built["metadata"], built["pkg_info"]):
        assert _headers(metadata, "License-File") == ["LICENSE"]
        assert _headers(metadata, "License-Expression") == ["Apache-2.0"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sdist_carries_every_test_and_example_file(built):
    wanted = [p for p in _source_files() if p.split("/", 1)[0] in SHIPPED_TREES]
    assert "tests/conftest.py" in wanted and "examples/quickstart.py" in wanted
    missing = [p for p in wanted if p not in built["sdist_files"]]
    assert not missing, f"not in the sdist: {missing}"
    # docs/bad-input.md and docs/loss-scales.md hold tables the tests read;
    # mkdocs.yml builds the docs in an unpacked sdist.
    for name in ("CHANGELOG.md", "README.md", "LICENSE", "docs/diagnose_scale.png",
                 "docs/bad-input.md", "docs/loss-scales.md", "mkdocs.yml"):
        assert name in built["sdist_files"], name


def test_readme_embeds_no_relative_image():
    """A relative image is broken on a package index page (README is the long
    description); refer to such files in text instead."""
    readme = (ROOT / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", readme) + re.findall(
        r"<img[^>]*\ssrc=[\"']([^\"']+)", readme
    )
    relative = [src for src in images if not re.match(r"[a-z]+://", src)]
    assert not relative, relative


def test_tensorboard_comes_with_its_extra_and_the_examples():
    """keras.callbacks.TensorBoard needs the tensorboard package (tensorflow-cpu 2.21 does not
    install it): the `tensorboard` and `examples` extras bring it."""
    from importlib import metadata

    requirements = metadata.requires("tfdls") or []
    for extra in ("tensorboard", "examples"):
        assert any(r.startswith("tensorboard") and f'extra == "{extra}"' in r
                   for r in requirements), (extra, requirements)
