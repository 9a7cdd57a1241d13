"""The wheel carries every package and the bundled examples eyas.paths points at."""

import fnmatch
from pathlib import Path

import pytest

import eyas
from eyas import paths

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed():
    src = Path(eyas.__file__).parent
    on_disk = {".".join(("eyas", *p.parent.relative_to(src).parts)) for p in src.rglob("__init__.py")}
    assert set(SETUPTOOLS["packages"]) == on_disk | {"eyas.examples"}
    assert SETUPTOOLS["package-dir"]["eyas.examples"] == "examples"


def test_the_defaults_are_bundled_files_the_wheel_ships():
    assert paths.EXAMPLES == ROOT / "examples"  # a checkout: its own examples/
    patterns = SETUPTOOLS["package-data"]["eyas.examples"]
    for default in paths.BUNDLED:
        files = [default] if default.is_file() else sorted(f for f in default.iterdir() if f.is_file())
        assert files, f"{default} is empty"
        for f in files:
            name = f.relative_to(paths.EXAMPLES).as_posix()
            assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not in the wheel's package data"


def test_the_wheel_ships_the_c_sources_compiled_on_first_use():
    src = Path(eyas.__file__).parent
    shipped = {f"{package}/{name}" for package, names in SETUPTOOLS["package-data"].items() for name in names}
    for source in src.rglob("*.c"):
        package = ".".join(("eyas", *source.parent.relative_to(src).parts))
        assert f"{package}/{source.name}" in shipped, f"{source} is not in the wheel's package data"


def test_a_missing_bundled_example_says_to_pass_the_model(monkeypatch, tmp_path):
    gone = tmp_path / "tiny-deepseek-v3"
    monkeypatch.setattr(paths, "BUNDLED", {gone: "a target checkpoint (--model DIR)"})
    hint = paths.missing_hint(f"{gone}: no such checkpoint directory")
    assert hint is not None and hint.endswith("give a target checkpoint (--model DIR)")
    assert paths.missing_hint("some/other/model: no such checkpoint directory") is None
    assert paths.missing_hint(f"{paths.DEFAULT_MODEL}: shape mismatch") is None  # it exists here


def test_the_command_line_says_what_to_give(monkeypatch, tmp_path, capsys):
    from eyas.cli import main

    gone = tmp_path / "tiny-deepseek-v3"
    monkeypatch.setattr(paths, "BUNDLED", {gone: "a target checkpoint (--model DIR)"})
    assert main(["generate", "--model", str(gone)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"eyas generate: error: {gone}: no such checkpoint directory"
    assert err[1].startswith("eyas generate: the bundled examples are not installed") and "--model DIR" in err[1]


def test_torch_floor_is_above_the_weights_only_advisories():
    """eyas torch.loads third-party dumps with weights_only=True, which could run code below torch 2.10
    (CVE-2025-32434 fixed in 2.6, CVE-2026-24747 in 2.10)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [d for d in deps if d.split(">")[0].split("=")[0].strip() == "torch"]
    floor = tuple(int(x) for x in torch_req.split(">=")[1].split(",")[0].split("."))
    assert floor >= (2, 10), torch_req
