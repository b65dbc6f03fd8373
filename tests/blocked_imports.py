"""Runs code in a fresh interpreter where some packages cannot be imported: what a machine
without them (the lent GPU machine: jax, numpy, jaxtyping and little else) would meet."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_without(blocked: tuple[str, ...], code: str, timeout: float = 600) -> str:
    """Runs `code` (dedented) with `blocked` packages refused at import; asserts it exits 0
    and prints "ok"; returns its stdout."""
    preamble = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
    """)
    out = subprocess.run([sys.executable, "-c", preamble + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    return out.stdout
