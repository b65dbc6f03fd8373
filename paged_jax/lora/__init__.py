"""LoRA adapters (vLLM's interface): `LoRARequest`, PEFT folders read into device slots
(peft_folder.py, weights.py) and the host's placement of adapters in slots (manager.py). The
batched delta itself is in the decoder's package: models/lora_ops.py."""

from paged_jax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
