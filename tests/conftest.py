"""Test-wide setup: jaxtyping shape annotations are checked at run time (beartype) for the
device-side modules imported during the tests, so a wrong shape fails loudly here."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Persist compiled programs between test runs (outside the repo, so clones share it); set
# before jax is imported. A cold cache only costs compile time.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "paged-jax" / "xla"))
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from jaxtyping import install_import_hook  # noqa: E402

# Device-side modules only: the user-facing API (SamplingParams, LLM) raises its own ValueErrors
# naming the bad field, which a type checker in front of it would pre-empt.
CHECKED = [
    "paged_jax.pool", "paged_jax.page_table", "paged_jax.kv_cache", "paged_jax.attention",
    "paged_jax.sampling", "paged_jax.models", "paged_jax.step", "kernels",
]
install_import_hook(CHECKED, "beartype.beartype")
