"""The pieces of sync and scheduling that need no server: path rules, folder scans, the allocator."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpuport.client._sync import HashCache, LocalFile, scan
from gpuport.protocol.errors import InvalidRequest
from gpuport.protocol.paths import check_entries, check_link, check_path
from gpuport.server.services.snapshots import Entry


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/etc/passwd", "absolute"),
        ("../secret", "'..'"),
        ("a/../../b", "'..'"),
        ("a//b", "not normalized"),
        ("./a", "not normalized"),
        ("", "empty"),
        ("a\0b", "NUL"),
        ("x" * 2000, "longer than"),
    ],
)
def test_bad_paths_are_refused_with_the_reason(path: str, problem: str) -> None:
    with pytest.raises(InvalidRequest, match=problem):
        check_path(path)


def test_good_paths_pass_and_a_trailing_slash_is_dropped() -> None:
    assert check_path("model/") == "model"
    assert check_path("a/b.c/d") == "a/b.c/d"


@pytest.mark.parametrize("target", ["/etc", "../x", "../../x", "a/../../.."])
def test_links_leaving_the_snapshot_are_refused(target: str) -> None:
    with pytest.raises(InvalidRequest, match="outside the workdir"):
        check_link("sub/link", target if not target.startswith("../") else "../" + target)


def test_links_inside_pass() -> None:
    assert check_link("sub/link", "../data.txt") == "../data.txt"


@pytest.mark.parametrize(
    ("links", "problem"),
    [
        ({"b": ".", "c": "b/b/../../etc"}, "leads outside the workdir"),  # lexically 'etc', on disk ../etc
        ({"sub/b": "..", "sub/c": "b/sub/b/../../x"}, "leads outside the workdir"),  # lexically sub/b/x
        ({"a": "b", "b": "a"}, "loops"),
    ],
)
def test_links_are_followed_through_other_links(links: dict[str, str], problem: str) -> None:
    with pytest.raises(InvalidRequest, match=problem):
        check_entries([Entry(path, "", 0, 0o777, link=target) for path, target in links.items()])


def test_chains_of_links_that_stay_inside_pass() -> None:
    links = {"b": ".", "c": "b/b/data", "d/e": "../c", "d/f": "../b/d/e"}
    check_entries([*(Entry(p, "", 0, 0o777, link=t) for p, t in links.items()), Entry("data", "a" * 64, 1, 0o644)])


def test_nothing_may_sit_below_a_symlink() -> None:
    entries = [
        Entry("d", "", 0, 0o777, link="real"),
        Entry("d/x", "a" * 64, 1, 0o644),
        Entry("real/y", "b" * 64, 1, 0o644),
    ]
    with pytest.raises(InvalidRequest, match="below the symlink"):
        check_entries(entries)


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def test_scan_honours_ignore_files_and_skips_git_caches_venvs_and_outputs(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "train.py": "x",
            ".gitignore": "*.log\nbuild/\n",
            ".gpuportignore": "data/raw/\n",
            "run.log": "x",
            "build/out.o": "x",
            "data/raw/big.bin": "x",
            "data/clean.csv": "x",
            "sub/.gitignore": "local.txt\n!keep.log\n",
            "sub/local.txt": "x",
            "sub/keep.log": "x",
            "sub/code.py": "x",
            ".git/HEAD": "x",
            "pkg/__pycache__/m.pyc": "x",
            "venv/pyvenv.cfg": "x",
            "venv/lib/site.py": "x",
            "gpuport-outputs/j-1/model.bin": "x",
        },
    )
    paths = {f.path for f in scan(tmp_path)}
    assert paths == {
        "train.py",
        ".gitignore",
        ".gpuportignore",
        "data/clean.csv",
        "sub/.gitignore",
        "sub/keep.log",
        "sub/code.py",
    }


def test_scan_keeps_inner_symlinks_and_refuses_one_leaving_the_workdir(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _tree(project, {"data/a.txt": "x"})
    os.symlink("data/a.txt", project / "inner")
    files = {f.path: f for f in scan(project)}
    assert files["inner"].link == "data/a.txt"
    (tmp_path / "secret").write_text("s")
    os.symlink(tmp_path / "secret", project / "leak")
    with pytest.raises(InvalidRequest, match=r"leak is a symlink to .*secret, outside the workdir"):
        scan(project)


def _hash_all(cache: HashCache, files: list[LocalFile]) -> list[LocalFile]:
    known, unknown = cache.split(files)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return known + cache.hash_files(unknown, pool)


def test_hash_cache_reuses_hashes_of_settled_files_only(tmp_path: Path) -> None:
    _tree(tmp_path / "p", {"old.txt": "old", "new.txt": "new"})
    old = tmp_path / "p" / "old.txt"
    os.utime(old, (1_000_000_000, 1_000_000_000))
    cache = HashCache(tmp_path / "p")
    first = {f.path: f.blob for f in _hash_all(cache, scan(tmp_path / "p"))}
    cache.save()
    assert set(HashCache(tmp_path / "p").entries) == {"old.txt"}  # new.txt was written just now
    old.write_text("changed")
    os.utime(old, (1_000_000_100, 1_000_000_100))
    second = {f.path: f.blob for f in _hash_all(HashCache(tmp_path / "p"), scan(tmp_path / "p"))}
    assert second["old.txt"] != first["old.txt"]
    assert second["new.txt"] == first["new.txt"]


def test_a_file_that_vanishes_while_syncing_is_named_in_a_clear_error(tmp_path: Path) -> None:
    _tree(tmp_path / "p", {"kept.txt": "kept", "gone.log": "written and removed by a running program"})
    files = scan(tmp_path / "p")
    (tmp_path / "p" / "gone.log").unlink()
    with pytest.raises(InvalidRequest, match="gone.log vanished while the folder was being synced"):
        with ThreadPoolExecutor(2) as pool:
            HashCache(tmp_path / "p").hash_files(files, pool)
