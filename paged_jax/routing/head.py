"""The complexity classifier: small MLPs over routing features that predict, for each model,
the probability that it answers a request correctly.

    raw features [B + E] (routing/features.py: B named features, then the weak model's hidden
    state) --> inputs: the named `columns`, and the hidden state projected on its top-k
    principal components (`pca`, fitted on the training rows; k may be 0)
      --standardize--> tanh(x W1 + b1) [HIDDEN] --> W2 + b2 --> logits [2] --/ T--> sigmoid
                                                                (weak ok, strong ok)

M members (different seeds, trained together) are averaged: one head is noisy on a few
hundred labelled requests. Each is trained with optax (AdamW, full batch, binary
cross-entropy on both outputs), then calibrated by temperature scaling: one temperature per
output, fitted on held-out rows by likelihood, so that "0.7" means right about 70% of the
time (`calibration` measures it). The router sends a request to the strong model when the
expected gain p_strong - p_weak is above a threshold, picked for a target share of
strong-model traffic (`threshold_for_share`).

Saved as a numpy .npz (a few KB of arrays) beside a JSON file (names, metrics); prediction
is numpy, so choosing a model costs microseconds, not a device call, and loading a head needs
no checkpoint library.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

HIDDEN = 16
TRAINED = Path(__file__).parent / "trained"  # what `python -m paged_jax.routing.train` writes
DEFAULT_PAIR = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")  # (weak, strong)


def pair_folder(weak: str, strong: str) -> Path:
    """Where the head trained for a (weak, strong) pair of shipped models is kept."""
    return TRAINED / f"{weak}+{strong}"


@dataclasses.dataclass
class Head:
    """A trained classifier: its members' weights (stacked on a leading [M] axis; unstacked
    weights are one member), the inputs' mean / std, temperatures [M, 2], and how inputs come
    from raw features: `columns` of the B = len(names) named ones, and `center` [E] /
    `components` [E, k] projecting the hidden state (k = 0: not used)."""

    params: dict[str, np.ndarray]
    mean: np.ndarray
    std: np.ndarray
    temperature: np.ndarray
    names: tuple[str, ...] = ()
    metrics: dict = dataclasses.field(default_factory=dict)
    columns: tuple[int, ...] | None = None  # None: all B named features
    center: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    components: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((0, 0), np.float32))

    def __post_init__(self):
        if np.ndim(self.params["w1"]) == 2:  # one member
            self.params = {k: np.asarray(v)[None] for k, v in self.params.items()}
        self.temperature = np.asarray(self.temperature, np.float32).reshape(-1, 2)
        self.temperature = np.broadcast_to(self.temperature, (len(self.params["w1"]), 2))

    def inputs(self, x: np.ndarray) -> np.ndarray:
        """[N, F] the head's inputs from raw features [N, B + E] (or [N, B] when k = 0)."""
        return inputs(x, len(self.names), self.columns, self.center, self.components)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """[M, N, 2] uncalibrated logits of (weak correct, strong correct), per member."""
        z = (self.inputs(x) - self.mean) / self.std
        return np.stack([_mlp({k: v[m] for k, v in self.params.items()}, z, np)
                         for m in range(len(self.params["w1"]))])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """[N, 2] calibrated probabilities that the weak / the strong model is right (the
        members' mean)."""
        t = self.temperature[:, None, :]
        return (0.5 + 0.5 * np.tanh(self.logits(x) / t / 2)).mean(0)  # sigmoid, no overflow

    def gain(self, x: np.ndarray) -> np.ndarray:
        """[N] expected gain of sending each request to the strong model: p_strong - p_weak."""
        p = self.predict(x)
        return p[:, 1] - p[:, 0]


def inputs(x: np.ndarray, b: int, columns: tuple[int, ...] | None, center: np.ndarray,
           components: np.ndarray) -> np.ndarray:
    """Head inputs [N, F]: the named `columns` of raw features x [N, B + E] (all B when None;
    b = 0: all of x), then x's hidden-state part projected: (h - center) @ components."""
    x = np.asarray(x, np.float32)
    b = b or x.shape[1]
    cols = x[:, :b] if columns is None else x[:, list(columns)]
    if not components.size:
        return cols
    if x.shape[1] - b != len(components):
        raise ValueError(f"this head projects a hidden state of size {len(components)}, but "
                         f"the features carry {x.shape[1] - b} values after the named ones: "
                         "was it trained on this weak model?")
    return np.concatenate([cols, (x[:, b:] - center) @ components], 1)


def _mlp(p, x, xp):
    return xp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def train(x: np.ndarray, y: np.ndarray, *, steps: int = 600, lr: float = 0.02,
          weight_decay: float = 1e-3, seed: int = 0, names: tuple[str, ...] = (),
          members: int = 1) -> Head:
    """Fits `members` MLPs (seeds seed, seed + 1, ...) to inputs x [N, F] and labels y [N, 2]
    in {0, 1} (temperature 1)."""
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    mean, std = x.mean(0), x.std(0) + 1e-6
    n = -(-len(x) // 128) * 128  # rows padded (weight 0): few shapes to compile
    pad = lambda a: np.pad(a, ((0, n - len(a)), (0, 0)))  # noqa: E731
    weight = jnp.asarray(np.arange(n) < len(x), jnp.float32)[:, None]
    keys = jnp.stack([jax.random.PRNGKey(seed + m) for m in range(members)])
    params = _fit(keys, jnp.asarray(pad((x - mean) / std)), jnp.asarray(pad(y)), weight,
                  steps=steps, lr=lr, weight_decay=weight_decay)
    return Head({k: np.asarray(v) for k, v in params.items()}, mean, std,
                np.ones((members, 2), np.float32), tuple(names))


@functools.partial(jax.jit, static_argnames=("steps", "lr", "weight_decay"))
def _fit(keys, xs, y, weight, *, steps: int, lr: float, weight_decay: float):
    """Full-batch AdamW for each member (vmapped over keys), in one scan."""
    opt = optax.adamw(lr, weight_decay=weight_decay)
    f = xs.shape[1]

    def one(key):
        k1, k2 = jax.random.split(key)
        p = {"w1": jax.random.normal(k1, (f, HIDDEN)) / np.sqrt(f), "b1": jnp.zeros(HIDDEN),
             "w2": jax.random.normal(k2, (HIDDEN, 2)) / np.sqrt(HIDDEN), "b2": jnp.zeros(2)}

        def loss(p):
            bce = optax.sigmoid_binary_cross_entropy(_mlp(p, xs, jnp), y)
            return (bce * weight).sum() / (2 * weight.sum())

        def update(c, _):
            p, state = c
            upd, state = opt.update(jax.grad(loss)(p), state, p)
            return (optax.apply_updates(p, upd), state), None

        return jax.lax.scan(update, (p, opt.init(p)), None, length=steps)[0][0]

    return jax.vmap(one)(keys)


def calibrate(head: Head, x: np.ndarray, y: np.ndarray) -> Head:
    """The head with one temperature per member and output fitted on raw features x and
    labels y by log-likelihood."""
    grid = np.exp(np.linspace(np.log(0.2), np.log(10.0), 200))
    temps = np.ones_like(head.temperature)
    for m, z in enumerate(head.logits(x)):
        for j in range(2):
            nll = [np.mean(np.logaddexp(0, z[:, j] / t) - y[:, j] * z[:, j] / t) for t in grid]
            temps[m, j] = grid[int(np.argmin(nll))]
    return dataclasses.replace(head, temperature=temps)


def pca(h: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(center [E], components [E, k]): the top-k principal directions of rows h [N, E]."""
    center = h.mean(0)
    _, _, vt = np.linalg.svd(h - center, full_matrices=False)
    return center.astype(np.float32), vt[:k].T.astype(np.float32)


def calibration(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error of probabilities p [N] against outcomes y [N]."""
    idx = np.minimum((p * bins).astype(int), bins - 1)
    return float(sum(abs(p[idx == b].mean() - y[idx == b].mean()) * (idx == b).mean()
                     for b in range(bins) if (idx == b).any()))


def threshold_for_share(gain: np.ndarray, share: float) -> float:
    """The gain threshold above which `share` of these requests go to the strong model."""
    if share <= 0:
        return np.inf
    if share >= 1:
        return -np.inf
    return float(np.quantile(gain, 1.0 - share))


def save(head: Head, folder: str | Path) -> Path:
    """Writes the head to `folder`: its arrays (folder/arrays.npz) and the rest as JSON."""
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    tree = {**head.params, "mean": head.mean, "std": head.std, "temperature": head.temperature}
    if head.components.size:
        tree.update(center=head.center, components=head.components)
    np.savez(folder / "arrays.npz", **{k: np.asarray(v) for k, v in tree.items()})
    (folder / "head.json").write_text(json.dumps(
        dict(names=list(head.names), metrics=head.metrics, hidden=HIDDEN,
             columns=None if head.columns is None else list(head.columns)), indent=1) + "\n")
    return folder


def load(folder: str | Path | None = None) -> Head:
    """A head written by `save` (default: the shipped one for DEFAULT_PAIR)."""
    folder = Path(folder or pair_folder(*DEFAULT_PAIR) / "head").absolute()
    if not (folder / "head.json").is_file():
        raise FileNotFoundError(f"no trained router head in {folder}; build one with "
                                "`python -m paged_jax.routing.train --weak W --strong S`")
    meta = json.loads((folder / "head.json").read_text())
    with np.load(folder / "arrays.npz") as arrays:
        tree = dict(arrays)
    params = {k: tree[k] for k in ("w1", "b1", "w2", "b2")}
    cols = meta.get("columns")
    return Head(params, tree["mean"], tree["std"], tree["temperature"], tuple(meta["names"]),
                meta["metrics"], None if cols is None else tuple(cols),
                *[tree[k] for k in ("center", "components") if k in tree])
