"""tfdls as it was at another commit, importable beside the installed one.

A change to a step worth a few percent of a small model's step can only be seen
with the code before and after it timed in one process, round by round: this
machine's step times move by more than that between processes. `import_at(rev)`
copies ``src/tfdls`` at git revision `rev` into a cache directory as the package
``tfdls_<commit>`` (every ``tfdls`` name in it rewritten, so that it imports
itself and registers its Keras objects under its own name) and imports it.

    python benchmarks/step_cost.py --cases mlp2x64-sgd --at HEAD~1

Timing `--at HEAD` beside an unchanged working tree measures the loop's own noise: the
same code twice.
"""

import importlib
import io
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(tempfile.gettempdir()) / "tfdls_versions"
_NAME = re.compile(r"\btfdls\b")


def commit_of(rev, repo=REPO):
    """The full commit hash of git revision `rev`; ValueError naming `rev` if git has none."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           cwd=repo, capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"versions: no commit {rev!r} in {repo}")
    return found.stdout.strip()


def package_name(commit):
    """The package name a copy of the commit is imported as."""
    return f"tfdls_{commit[:10]}"


def import_at(rev, repo=REPO, cache=CACHE):
    """The tfdls package of revision `rev`, imported as ``tfdls_<commit>`` (a module).

    Args:
        rev: a git revision of `repo` ("HEAD~2", a hash, a tag).
        repo: the repository.
        cache: where copies are kept (one per commit, made once).

    Raises:
        ValueError: `rev` is not a commit of `repo`.
    """
    name = package_name(commit_of(rev, repo))
    root = pathlib.Path(cache) / name
    if not (root / name).exists():
        # Written beside, then renamed: an interrupted copy is never imported.
        partial = root / f"{name}.partial"
        _copy(commit_of(rev, repo), repo, partial, name)
        partial.rename(root / name)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(name)


def _copy(commit, repo, dest, name):
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "src/tfdls"],
                             cwd=repo, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            relative = pathlib.PurePosixPath(member.name).relative_to("src/tfdls")
            data = tar.extractfile(member).read()
            if relative.suffix == ".py":
                data = _NAME.sub(name, data.decode()).encode()
            path = dest / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
