"""llama.cpp (through llama-cpp-python) as a side of `make bench`: a worker in its own venv.

    .venv-llama/bin/python experiments/peer_llamacpp.py GGUF --max-seqs 64 --max-len 512

It serves the same GGUF file paged-jax loads (llama.cpp computes with the file's quantized
weights; paged-jax dequantizes them to float32 at load). Commands arrive on stdin as JSON
lines and answers leave on stdout (experiments/peer_protocol.py):

    {"op": "run", "prompts": [[ids], ...], "tokens": N}
        -> {"seconds": s, "tokens": [[ids], ...]}
    {"op": "score", "ids": [ids]}
        -> {"nll": [-log p(ids[i + 1] | ids[:i + 1]), ...]}    (teacher-forced, one sequence)

Greedy (the argmax of each sequence's logits), exactly N tokens per prompt (EOS ignored). All
prompts of a run are parallel sequences of one context, as llama.cpp's server runs them: one
llama_decode per step carries one token of every sequence (prompts go in chunks of n_batch
tokens first). Only llama-cpp-python and numpy are imported: the venv holds nothing else.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import peer_protocol  # noqa: E402  (standalone: this venv has no paged_jax)

peer_protocol.quiet()  # llama.cpp may print to stdout: only answers may go there


class LlamaCpp:
    """One llama.cpp context with room for `max_seqs` sequences of `max_len` tokens."""

    def __init__(self, gguf: str, max_seqs: int, max_len: int, threads: int,
                 extra_buffers: bool = True):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.use_extra_bufts = extra_buffers
        self.model = lc.llama_model_load_from_file(gguf.encode(), mp)
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max = max_seqs * max_len, max_seqs
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False  # a KV stream per sequence: attention reads its own cells
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch, self.max_seqs = params.n_batch, max_seqs
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self.settings = dict(n_ctx=params.n_ctx, n_seq_max=params.n_seq_max,
                             n_batch=params.n_batch, threads=params.n_threads,
                             kv_unified=bool(params.kv_unified), weights="the GGUF's own types",
                             extra_buffer_types=extra_buffers)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, int(out)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed (context too small for the batch?)")

    def _logits(self, i: int) -> np.ndarray:
        row = self.lc.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)),
                                     shape=(self.n_vocab,))

    def _argmax(self, i: int) -> int:
        return int(self._logits(i).argmax())

    def score(self, ids: list[int]) -> list[float]:
        """Teacher-forced: -log p of each next token of `ids`, as one sequence."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        nll = []
        for start in range(0, len(ids) - 1, self.n_batch):
            chunk = [(t, start + i, 0, True) for i, t in enumerate(ids[start:start + self.n_batch])]
            self._decode(chunk)
            for i, (_, pos, _, _) in enumerate(chunk):
                if pos + 1 < len(ids):
                    z = self._logits(i).astype(np.float64)
                    nll.append(float(np.logaddexp.reduce(z) - z[ids[pos + 1]]))
        return nll

    def run(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        """Greedy `tokens` tokens for every prompt, decoded together."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        items = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts)
                 for p, t in enumerate(ids)]
        first: dict[int, int] = {}
        for start in range(0, len(items), self.n_batch):  # the prompts, in chunks
            chunk = items[start:start + self.n_batch]
            self._decode(chunk)  # a chunk's logits are gone after the next decode: read now
            first.update({s: self._argmax(i) for i, (_, _, s, out) in enumerate(chunk) if out})
        out = [[first[s]] for s in range(len(prompts))]
        for step in range(1, tokens):
            self._decode([(o[-1], len(ids) + step - 1, s, True)
                          for s, (ids, o) in enumerate(zip(prompts, out, strict=True))])
            for s, o in enumerate(out):
                o.append(self._argmax(s))
        return out


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_int8" in f.read()
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--extra-buffers", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp's extra CPU buffer types (AMX, weight repacking); auto: "
                         "off on CPUs with AMX, whose matmul crashed llama.cpp (SIGSEGV in "
                         "ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36, a Xeon with AMX)")
    a = ap.parse_args()
    from importlib import metadata

    extra = a.extra_buffers == "on" or (a.extra_buffers == "auto" and not _has_amx())
    side = LlamaCpp(a.gguf, a.max_seqs, a.max_len, a.threads, extra)

    def run(cmd: dict) -> dict:
        if cmd.get("op") == "score":
            return dict(nll=side.score(cmd["ids"]))
        t0 = time.perf_counter()
        toks = side.run(cmd["prompts"], cmd["tokens"])
        return dict(seconds=time.perf_counter() - t0, tokens=toks)

    peer_protocol.serve(run, versions={"llama_cpp_python": metadata.version("llama-cpp-python")},
                        settings=side.settings)


if __name__ == "__main__":
    main()
