"""Tokenizer: a `tokenizers` BPE (from GGUF metadata or tokenizer.json) + a jinja chat template.

GGUF files describe two kinds: byte-level BPE ("gpt2": SmolLM2, Llama 3, Qwen2) with its merges
listed, and SentencePiece BPE ("llama": Gemma 3) with none. For the second the merges are
recovered from the vocabulary, as transformers' GGUF conversion does for Gemma: every split of
a token into two tokens is a merge, ranked by the merged token's place in the file.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's pre-tokenizer names -> the split regex its vocabulary was trained with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
SPACE = "\u2581"  # SentencePiece's visible space
SENTENCEPIECE_ARCHS = ("gemma3",)  # the SentencePiece GGUFs checked against transformers


class Tokenizer:
    """Text <-> token ids and chat formatting for one checkpoint."""

    def __init__(
        self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
        chat_template: str | None, add_bos: bool = False, eos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        # The tokenizer's own EOS (the chat template's `eos_token`); the config may list others.
        self.eos_token_id = eos_token_id if eos_token_id is not None else (
            self.eos_token_ids[0] if self.eos_token_ids else None)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings (e.g. <|im_start|>) map to their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens dropped unless asked for."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, i: int | None) -> str:
        return "" if i is None else (self.backend.id_to_token(i) or "")

    def apply_chat_template(
        self, messages: list, add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        """Renders `messages` with a jinja chat template (as transformers does): `chat_template`
        if given, else the checkpoint's."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this checkpoint has no chat template; pass chat_template=...")
        check_messages(messages)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent)
        env.globals["raise_exception"] = _raise
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_token_id), eos_token=self.token(self.eos_token_id),
        )


def check_messages(messages: list) -> None:
    """A clear error for a conversation a template cannot render (jinja's own is cryptic)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] has no {key!r} (keys: {sorted(m)})")
        if not isinstance(m["role"], str):
            raise ValueError(f"messages[{i}]['role'] must be a string, got {m['role']!r}")


def _raise(msg: str) -> None:
    raise jinja2.TemplateError(msg)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's `tokenizer.ggml.pre` as a `tokenizers` pre-tokenizer."""
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: each digit alone, then the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in (None, "default", "gpt-2", "gpt2"):
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2's split", stacklevel=3)
    return byte_level


def _byte_level(meta: dict[str, Any]) -> tuple[HFTokenizer, list[str]]:
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    return tok, tokens


def merges_from_vocab(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens that concatenates to a token, best first: by the
    merged token's index, then the longer left part first."""
    index = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first spelling wins
    ranked = [(i, -cut, tok[:cut], tok[cut:]) for i, tok in enumerate(tokens)
              for cut in range(1, len(tok)) if tok[:cut] in index and tok[cut:] in index]
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in ranked]


def _sentencepiece(meta: dict[str, Any]) -> tuple[HFTokenizer, list[str]]:
    """SentencePiece BPE with byte fallback; spaces are SPACE inside tokens."""
    # Gemma stores runs of spaces as real spaces; the normalizer turns text spaces into SPACE.
    tokens = [SPACE * len(t) if t and not t.strip(" ") else t
              for t in meta["tokenizer.ggml.tokens"]]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE(
        {t: i for i, t in reversed(list(enumerate(tokens)))}, merges_from_vocab(tokens),
        unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tok.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend(SPACE)] if prefix else []), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    # Respelled space runs are ordinary tokens, not added ones (those match the raw text).
    original = meta["tokenizer.ggml.tokens"]
    return tok, [t if t == s else "" for t, s in zip(tokens, original, strict=True)]


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """Builds the tokenizer from GGUF `tokenizer.*` metadata: byte-level BPE, or Gemma 3's
    SentencePiece BPE (module docstring)."""
    kind, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
    if kind == "gpt2":
        tok, tokens = _byte_level(meta)
    elif kind == "llama" and arch in SENTENCEPIECE_ARCHS:
        tok, tokens = _sentencepiece(meta)
    else:
        sp = " (SentencePiece)" if kind == "llama" else ""
        raise ValueError(f"GGUF tokenizer model {kind!r}{sp} of a {arch!r} file is not "
                         "supported: byte-level BPE ('gpt2'), or SentencePiece for "
                         f"{SENTENCEPIECE_ARCHS}. Load the model's Hugging Face folder (its "
                         "tokenizer.json) instead of the .gguf file.")
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if t and k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if t and k == USER_DEFINED])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(
        tok, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(gguf_stop_ids(meta)),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)), eos_token_id=eos,
    )


# Control tokens that end a generation whatever the file's eos says (llama.cpp's rule for
# GGUFs, which carry no generation config: Qwen2.5 stops on <|im_end|> and <|endoftext|>).
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                     "<end_of_turn>")


def gguf_stop_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """The ids that end a generation: the file's eos and eot, then END_OF_GENERATION's
    control tokens."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    named = [i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
             if k == CONTROL and t in END_OF_GENERATION]
    ids = (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"),
           *named)
    return tuple(i for i in dict.fromkeys(ids) if i is not None)


def _special_id(tok: HFTokenizer, spec: Any) -> int | None:
    text = spec.get("content") if isinstance(spec, dict) else spec
    return None if text is None else tok.token_to_id(text)


def tokenizer_from_folder(folder: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja) of a Hugging Face folder."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    tok = HFTokenizer.from_file(str(path))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    eos = _special_id(tok, cfg.get("eos_token"))
    return Tokenizer(
        tok, bos_token_id=_special_id(tok, cfg.get("bos_token")),
        eos_token_ids=list(dict.fromkeys([*eos_token_ids, *([eos] if eos is not None else [])])),
        chat_template=template if isinstance(template, str) else None,
        add_bos=bool(cfg.get("add_bos_token", False)), eos_token_id=eos,
    )


def save_tokenizer(tok: Tokenizer, folder: Path) -> None:
    """Writes tokenizer.json and our tokenizer_meta.json (ids, template) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.backend.to_str())
    meta = dict(bos_token_id=tok.bos_token_id, eos_token_ids=list(tok.eos_token_ids),
                chat_template=tok.chat_template, add_bos=tok.add_bos,
                eos_token_id=tok.eos_token_id)
    (folder / "tokenizer_meta.json").write_text(json.dumps(meta))


def load_saved_tokenizer(folder: Path) -> Tokenizer:
    """Inverse of `save_tokenizer`."""
    folder = Path(folder)
    meta = json.loads((folder / "tokenizer_meta.json").read_text())
    return Tokenizer(HFTokenizer.from_file(str(folder / "tokenizer.json")), **meta)
