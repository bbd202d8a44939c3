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

import dataclasses
import importlib
import io
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(tempfile.gettempdir()) / "tfdls_versions"
# Part of every copy's path: a change to how copies are made makes new ones.
REWRITE = 1
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


def copy_at(rev, repo=REPO, cache=None):
    """The directory holding the package ``tfdls_<commit>``, a copy of `rev`'s ``src/tfdls``
    with every ``tfdls`` name rewritten; made once per commit.

    Args:
        rev: a git revision of `repo` ("HEAD~2", a hash, a tag).
        repo: the repository.
        cache: where copies are kept (default `CACHE`).

    Raises:
        ValueError: `rev` is not a commit of `repo`, or has no ``src/tfdls``.
    """
    commit = commit_of(rev, repo)
    name = package_name(commit)
    root = pathlib.Path(CACHE if cache is None else cache) / f"rewrite{REWRITE}" / name
    if not (root / name).exists():
        root.mkdir(parents=True, exist_ok=True)
        # Made in a directory of its own, then renamed into place: an interrupted copy is
        # never imported, and two processes copying at once both end with one copy.
        partial = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f"{name}."))
        try:
            _copy(commit, repo, partial, name)
            partial.rename(root / name)
        except OSError:
            if not (root / name).exists():
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return root


def import_at(rev, repo=REPO, cache=None):
    """The tfdls package of revision `rev`, imported as ``tfdls_<commit>`` (a module).

    Arguments and errors as `copy_at`'s.
    """
    root = copy_at(rev, repo, cache)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(root.name)


def revisions(parser, text):
    """The revisions of an ``--at`` option (`text`, comma-separated), each checked with git;
    a revision named twice or unknown to git is `parser.error` (before TensorFlow loads)."""
    revs = [rev.strip() for rev in text.split(",") if rev.strip()]
    if len(set(revs)) != len(revs):
        parser.error(f"--at names a revision twice: {','.join(revs)!r}")
    for rev in revs:
        try:
            commit_of(rev)
        except ValueError as error:
            parser.error(f"--at {rev}: {error}")
    return revs


def variant_at(cases, rev):
    """Declares the variant ``tfdls@REV`` in `cases` (the module): the "tfdls" variant run
    with tfdls as it was at git revision `rev` (`import_at`); returns its name."""
    name = f"tfdls@{rev}"
    package = import_at(rev).__name__
    cases.VARIANTS[name] = dataclasses.replace(cases.VARIANTS["tfdls"],
                                               label=f"tfdls at {rev}", package=package)
    return name


def tfdls_to(result, names):
    """tfdls' median per-round ratio to each variant of `names`, by name, from one case's
    `timing.measure` result (each variant's ``samples_ms``, timed in the same rounds)."""
    import timing

    return {name: timing.summarize({other: result[other]["samples_ms"]
                                    for other in (name, "tfdls")})["tfdls"]["ratio"]
            for name in names}


def _copy(commit, repo, dest, name):
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "src/tfdls"],
                             cwd=repo, capture_output=True)
    if archive.returncode != 0:
        raise ValueError(f"versions: commit {commit} has no src/tfdls: "
                         f"{archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
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
