"""Issue 52, case 12 and the cache-root low items: one cache root for everything Pomona
keeps ($POMONA_CACHE, else $XDG_CACHE_HOME/pomona), checked before any verb starts, so a bad
setting is one line naming the variable (it was a traceback after Ray had started, or an
error blaming --out)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from engine.cli import main as engine_main
from engine.host.cache import cache_root

pytestmark = pytest.mark.unit


def bad_roots(tmp_path: Path) -> dict[str, str]:
    """Each way the variable can be wrong, and what the line says of it."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    return {str(a_file): "is a file", str(a_file / "cache"): f"lies under {a_file}, a file",
            "/proc/pomona-cache": "is a kernel file system"}


def test_a_bad_cache_root_is_one_line_before_any_verb(tmp_path: Path, monkeypatch,
                                                      capsys) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: s\nmodel: {tmp_path}\ndata: {spec}\n")
    for root, said in bad_roots(tmp_path).items():
        for verb in (["sweep", str(spec)], ["leaderboard", str(tmp_path), "--model", "m",
                                            "--data", "d"],
                     ["pipeline", str(spec), str(tmp_path), str(spec)]):
            result = CliRunner().invoke(app, verb, env={"POMONA_CACHE": root})
            lines = [x for x in result.output.splitlines() if x.strip()]
            assert result.exit_code == 2 and len(lines) == 1, result.output
            assert f"POMONA_CACHE={root}: " in lines[0] and said in lines[0], lines[0]
        monkeypatch.setenv("POMONA_CACHE", root)
        assert engine_main(["train", "--model", "m", "--data", "d"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"POMONA_CACHE={root}: " in err[0] and said in err[0], err


def test_everything_pomona_keeps_lies_under_one_root(tmp_path: Path, monkeypatch) -> None:
    """reference/, models/ and file-hashes.json followed XDG_CACHE_HOME only, while the
    inputs' copies followed POMONA_CACHE."""
    from engine.host.digests import hash_cache_path
    from engine.model.source import models_cache
    from engine.train.reference import cache_dir
    from tasks.nodes.node_files import Bundle, fetch, local_reader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("POMONA_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    for kept in (hash_cache_path(), cache_dir(), models_cache()):
        assert kept.is_relative_to(tmp_path / "mine"), kept
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(b"w")
    planned = Bundle.of(tmp_path / "model")
    elsewhere = Bundle(str(tmp_path / "node" / "model"), planned.files, planned.digest, True)
    assert Path(fetch(elsewhere, local_reader(planned))).is_relative_to(tmp_path / "mine")
    assert (tmp_path / "mine" / "file-hashes.json").is_file()
    assert not (tmp_path / "xdg").exists()
    monkeypatch.delenv("POMONA_CACHE")
    assert cache_root() == tmp_path / "xdg" / "pomona"
