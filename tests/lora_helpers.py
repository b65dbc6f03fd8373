"""Tiny Hugging Face models and random PEFT adapters saved to folders: what the LoRA tests
load on both sides (ours and transformers + peft)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, rslora, targets): three adapters that differ in each
ADAPTERS = [(4, 8, False, ALL), (8, 16, True, ["q_proj", "v_proj", "down_proj"]),
            (2, 2, False, ["k_proj", "o_proj", "gate_proj", "up_proj"])]


def hf_model(folder: Path, kind: str = "llama", seed: int = 0):
    """A 2-layer random HF model of `kind` ("llama" or "qwen2") saved as safetensors."""
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return model


def random_adapter(model, folder: Path, rank: int, alpha: float, rslora: bool,
                   targets: list[str], seed: int) -> Path:
    """A PEFT LoRA of `model` with random A and B (PEFT starts B at zero), saved to
    `folder`; the model is left unwrapped."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                             target_modules=targets, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    wrapped.save_pretrained(folder)
    wrapped.unload()
    return folder


def peft_logits(base_folder: Path, adapter: Path | None, ids: list[int]) -> np.ndarray:
    """[T, V] float32 logits of `ids` from transformers (+ the adapter through peft)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder,
                                                              torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def peft_greedy(base_folder: Path, adapter: Path | None, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` from transformers (+ the adapter through peft)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder,
                                                              torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def merged_model(base_folder: Path, adapter: Path, folder: Path) -> Path:
    """The base model with `adapter` merged into its weights (peft's merge_and_unload),
    saved as safetensors to `folder`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder,
                                                              torch_dtype=torch.float32)
    peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(
        folder, safe_serialization=True)
    return folder
