"""LoRA adapters behind the server (`--lora-modules`): each adapter is a model of its own in
/v1/models (with its base as `parent`), a request naming it gets the adapter's tokens, the
base model's stay the base's; the CLI's flag parses and refuses what it cannot serve."""

from __future__ import annotations

import httpx
import pytest

from experiments.lora import write_adapter
from paged_jax.llm import LLM
from paged_jax.lora import LoRARequest
from paged_jax.sampling_params import SamplingParams
from paged_jax.serve import cli
from paged_jax.serve.api import build_app
from paged_jax.serve.background import Server
from tests.engine_helpers import model
from tests.serve_helpers import ENGINE

PROMPT = "a question about adapters"


def test_adapters_are_models_of_their_own(tmp_path):
    parts = model()
    paths = {f"a{i}": str(write_adapter(tmp_path / f"a{i}", parts[0], seed=i, scale=0.5))
             for i in (0, 1)}
    llm = LLM(model_parts=parts, **ENGINE, enable_lora=True, max_loras=2)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {"tiny": llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]}
    for i, (name, path) in enumerate(paths.items(), start=1):
        outs[name] = llm.generate(PROMPT, sp, use_tqdm=False,
                                  lora_request=LoRARequest(name, 10 + i, path))[0].outputs[0]
    assert len({tuple(o.token_ids) for o in outs.values()}) == 3, "the adapters changed nothing"
    want = {name: o.text for name, o in outs.items()}
    with Server(build_app(llm, "tiny", lora_modules=paths)) as srv:
        listed = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == ["tiny", "a0", "a1"]
        assert [m.get("parent") for m in listed] == [None, "tiny", "tiny"]
        for name in ["a1", "tiny", "a0"]:
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json=dict(
                model=name, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[name], name


def test_lora_modules_are_checked_before_serving(tmp_path):
    llm = LLM(model_parts=model(), **ENGINE)
    with pytest.raises(ValueError, match="enable_lora=True"):
        build_app(llm, "tiny", lora_modules={"a": str(tmp_path)})
    llm = LLM(model_parts=model(), **ENGINE, enable_lora=True)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        build_app(llm, "tiny", lora_modules={"a": str(tmp_path)})
    with pytest.raises(ValueError, match="taken"):
        build_app(llm, "tiny", lora_modules={"tiny": str(tmp_path)})
    assert cli.lora_modules(["x=/p", "y=/q/r"]) == {"x": "/p", "y": "/q/r"}
    with pytest.raises(SystemExit, match="NAME=PATH"):
        cli.lora_modules(["nopath"])
