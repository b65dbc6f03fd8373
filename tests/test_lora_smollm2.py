"""LoRA on a real model: SmolLM2-135M-Instruct with random PEFT adapters of rank 8 and 16 on
every projection, our greedy tokens against transformers + PEFT on the same GGUF, fp32."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

from paged_jax.llm import LLM  # noqa: E402
from paged_jax.lora import LoRARequest  # noqa: E402
from paged_jax.models import default_model_path  # noqa: E402
from paged_jax.sampling_params import SamplingParams  # noqa: E402
from tests.lora_helpers import ALL  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "How do I reverse a list in Python?"]
TOKENS = 16


def hf_smollm2():
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_greedy_tokens_equal_peft_at_rank_8_and_16(tmp_path):
    llm = LLM(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=256)
    tok = llm.get_tokenizer()
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], True))
           for p in PROMPTS]
    loras, want = [], {}
    for rank in (8, 16):
        torch.manual_seed(rank)
        wrapped = peft.get_peft_model(hf_smollm2(), peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=ALL, lora_dropout=0.0))
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: a random one changes the output
                    p.copy_(torch.randn_like(p) * 0.02)
        wrapped.save_pretrained(tmp_path / f"r{rank}")
        loras.append(LoRARequest(f"r{rank}", rank, str(tmp_path / f"r{rank}")))
        with torch.no_grad():
            want[rank] = [wrapped.generate(torch.tensor([i]), max_new_tokens=TOKENS,
                                           do_sample=False)[0, len(i):].tolist() for i in ids]
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    base = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)]
    prompts = [{"prompt_token_ids": i} for i in ids] * 2
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=[loras[0]] * 4 + [loras[1]] * 4)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[:4] == [w[:len(g)] for w, g in zip(want[8], got[:4], strict=True)]
    assert got[4:] == [w[:len(g)] for w, g in zip(want[16], got[4:], strict=True)]
    assert got[:4] != base and got[4:] != base, "the adapters changed no token"
