"""The complexity classifier: a small MLP over routing features that predicts, for each model,
the probability that it answers a request correctly.

    x [F] --standardize--> tanh(x W1 + b1) [HIDDEN] --> W2 + b2 --> logits [2] --/ T--> sigmoid
                                                                (weak ok, strong ok)

Trained with optax (AdamW, full batch, binary cross-entropy on both outputs), then calibrated
by temperature scaling: one temperature per output, fitted on held-out rows by likelihood, so
that "0.7" means right about 70% of the time (`calibration` measures it). The router sends a
request to the strong model when the expected gain p_strong - p_weak is above a threshold,
picked for a target share of strong-model traffic (`threshold_for_share`).

Saved with orbax-checkpoint (arrays) beside a JSON file (names, metrics); prediction is numpy,
so choosing a model costs microseconds, not a device call.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

HIDDEN = 16
TRAINED = Path(__file__).parent / "trained"  # what `python -m paged_jax.routing.train` writes


@dataclasses.dataclass
class Head:
    """A trained classifier: its weights, the training features' mean / std, temperatures."""

    params: dict[str, np.ndarray]
    mean: np.ndarray
    std: np.ndarray
    temperature: np.ndarray  # [2]
    names: tuple[str, ...] = ()
    metrics: dict = dataclasses.field(default_factory=dict)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """[N, 2] uncalibrated logits of (weak correct, strong correct)."""
        return _mlp({k: np.asarray(v) for k, v in self.params.items()},
                    (np.asarray(x, np.float32) - self.mean) / self.std, np)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """[N, 2] calibrated probabilities that the weak / the strong model is right."""
        return 0.5 + 0.5 * np.tanh(self.logits(x) / self.temperature / 2)  # sigmoid, no overflow

    def gain(self, x: np.ndarray) -> np.ndarray:
        """[N] expected gain of sending each request to the strong model: p_strong - p_weak."""
        p = self.predict(x)
        return p[:, 1] - p[:, 0]


def _mlp(p, x, xp):
    return xp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def train(x: np.ndarray, y: np.ndarray, *, steps: int = 600, lr: float = 0.02,
          weight_decay: float = 1e-3, seed: int = 0, names: tuple[str, ...] = ()) -> Head:
    """Fits the MLP to features x [N, F] and labels y [N, 2] in {0, 1} (temperature 1)."""
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    mean, std = x.mean(0), x.std(0) + 1e-6
    xs = jnp.asarray((x - mean) / std)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    f = x.shape[1]
    params = {"w1": jax.random.normal(k1, (f, HIDDEN)) / np.sqrt(f), "b1": jnp.zeros(HIDDEN),
              "w2": jax.random.normal(k2, (HIDDEN, 2)) / np.sqrt(HIDDEN), "b2": jnp.zeros(2)}
    opt = optax.adamw(lr, weight_decay=weight_decay)

    def loss(p):
        return optax.sigmoid_binary_cross_entropy(_mlp(p, xs, jnp), jnp.asarray(y)).mean()

    @jax.jit
    def update(p, state):
        value, grads = jax.value_and_grad(loss)(p)
        upd, state = opt.update(grads, state, p)
        return optax.apply_updates(p, upd), state, value

    state = opt.init(params)
    for _ in range(steps):
        params, state, _ = update(params, state)
    return Head({k: np.asarray(v) for k, v in params.items()}, mean, std,
                np.ones(2, np.float32), tuple(names))


def calibrate(head: Head, x: np.ndarray, y: np.ndarray) -> Head:
    """The head with one temperature per output fitted on (x, y) by log-likelihood."""
    z = head.logits(x)
    grid = np.exp(np.linspace(np.log(0.2), np.log(10.0), 200))
    temps = []
    for j in range(2):
        nll = [np.mean(np.logaddexp(0, z[:, j] / t) - y[:, j] * z[:, j] / t) for t in grid]
        temps.append(grid[int(np.argmin(nll))])
    return dataclasses.replace(head, temperature=np.asarray(temps, np.float32))


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
    """Writes the head to `folder`: arrays with orbax (folder/arrays), the rest as JSON."""
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    tree = {**head.params, "mean": head.mean, "std": head.std, "temperature": head.temperature}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(folder / "arrays", {k: np.asarray(v) for k, v in tree.items()}, force=True)
    (folder / "head.json").write_text(json.dumps(
        dict(names=list(head.names), metrics=head.metrics, hidden=HIDDEN), indent=1) + "\n")
    return folder


def load(folder: str | Path | None = None) -> Head:
    """A head written by `save` (default: the shipped one, TRAINED / "head")."""
    folder = Path(folder or TRAINED / "head").absolute()
    if not (folder / "head.json").is_file():
        raise FileNotFoundError(f"no trained router head in {folder}; build one with "
                                "`python -m paged_jax.routing.train`")
    meta = json.loads((folder / "head.json").read_text())
    with ocp.StandardCheckpointer() as ckpt:
        tree = {k: np.asarray(v) for k, v in ckpt.restore(folder / "arrays").items()}
    params = {k: tree[k] for k in ("w1", "b1", "w2", "b2")}
    return Head(params, tree["mean"], tree["std"], tree["temperature"], tuple(meta["names"]),
                meta["metrics"])
