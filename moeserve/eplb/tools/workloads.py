"""Expert-load workloads: synthetic generators and the recorder dump format they share with real runs.

A workload is `logical_count`, an int64 array [steps, layers, experts]: how many tokens each forward pass
routed to each logical expert of each MoE layer. A serving run's recorder writes it (SGLang's
`expert_distribution_recorder_*.pt` holds the same key); the analysis tools read it back from a .pt, .npy
or .npz file.

The synthetic generator draws, for every step and layer, a multinomial of `tokens_per_step * topk` routed
(token, expert) pairs over the layer's expert popularity. Popularity is Zipf (rank r gets share ∝ r^-s) or
lognormal (share ∝ exp(sigma * N(0, 1))), assigned to experts by an independent random permutation per layer,
and drifts over time as a random walk of step size `drift` in log space. Pairs are drawn independently,
which ignores that one token's k experts are distinct; so that the expectation stays feasible, an expert's
share is capped at 1/topk (every token picks it) and the excess spread over the others.

Tokens of one sequence route alike (a prompt has a topic, a language). With `seq_len` > 1 a step is made
of tokens_per_step / seq_len sequences, each drawing its pairs from its own popularity, the layer's
log-popularity plus `seq_sigma` * N(0, 1) per expert. Few long sequences per step (prefill) are then less
balanced than many independent tokens (decode), as in recorded serving runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

DISTRIBUTIONS = ("zipf", "lognormal", "uniform")


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate: sizes, popularity law, drift and seed."""

    num_layers: int = 58
    num_experts: int = 256
    num_steps: int = 200
    tokens_per_step: int = 8192
    topk: int = 8
    dist: str = "zipf"
    zipf_exponent: float = 0.55  # s in share ∝ rank^-s; 0.55 over 256 experts: hottest ≈ 10x the mean
    lognormal_sigma: float = 1.0  # sigma of log-popularity; 1.0: hottest ≈ 9x the mean over 256 experts
    drift: float = 0.01  # std of the per-step random walk of log-popularity (0: stationary)
    seq_len: int = 1  # tokens of one sequence in a step (1: every token independent, as in decode)
    seq_sigma: float = 1.0  # per-sequence noise of log-popularity when seq_len > 1
    num_groups: int = 1  # expert groups (DeepSeek-V3: 8); recorded in meta for EPLB's hierarchical policy
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError for a spec that cannot be generated."""
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"unknown --dist {self.dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
        sizes = ("num_layers", "num_experts", "num_steps", "tokens_per_step", "topk", "num_groups", "seq_len")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk {self.topk} exceeds the number of experts {self.num_experts}")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_groups {self.num_groups} must divide num_experts {self.num_experts}")
        if min(self.drift, self.lognormal_sigma, self.zipf_exponent, self.seq_sigma) < 0:
            raise ValueError("drift, lognormal_sigma, zipf_exponent and seq_sigma must be >= 0")


def base_log_popularity(spec: WorkloadSpec, rng: np.random.Generator) -> np.ndarray:
    """Log-popularity [layers, experts] at step 0, each layer an independent permutation of the law."""
    num_layers, num_experts = spec.num_layers, spec.num_experts
    if spec.dist == "zipf":
        ranked = -spec.zipf_exponent * np.log(np.arange(1, num_experts + 1, dtype=np.float64))
        return np.stack([ranked[rng.permutation(num_experts)] for _ in range(num_layers)])
    if spec.dist == "lognormal":
        return spec.lognormal_sigma * rng.standard_normal((num_layers, num_experts))
    return np.zeros((num_layers, num_experts))


def capped_shares(log_popularity: np.ndarray, topk: int) -> np.ndarray:
    """Softmax over the last axis, with every share capped at 1/topk (water-filling the excess)."""
    shares = np.exp(log_popularity - log_popularity.max(-1, keepdims=True))
    shares /= shares.sum(-1, keepdims=True)
    cap = 1.0 / topk
    for _ in range(topk + 1):  # each round fixes at least one expert at the cap
        over = shares > cap
        if not over.any():
            break
        free_mass = 1.0 - cap * over.sum(-1, keepdims=True)
        under_mass = np.where(over, 0.0, shares).sum(-1, keepdims=True)
        scale = np.divide(free_mass, under_mass, out=np.ones_like(free_mass), where=under_mass > 0)
        shares = np.where(over, cap, shares * scale)
    return shares


def generate(spec: WorkloadSpec) -> np.ndarray:
    """Synthetic logical_count, int64 [steps, layers, experts]; each (step, layer) sums to tokens * topk."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    log_pop = base_log_popularity(spec, rng)
    counts = np.empty((spec.num_steps, spec.num_layers, spec.num_experts), dtype=np.int64)
    for step in range(spec.num_steps):
        if step and spec.drift:
            log_pop = log_pop + spec.drift * rng.standard_normal(log_pop.shape)
        counts[step] = draw_step(log_pop, spec, rng)
    return counts


def draw_step(log_pop: np.ndarray, spec: WorkloadSpec, rng: np.random.Generator) -> np.ndarray:
    """One step's counts [L, E]: tokens_per_step * topk pairs, whole sequences of seq_len tokens at a time.

    With sequences, the pairs are drawn from the token-weighted mixture of the sequences' popularities: the
    spread between sequences is kept exactly, the multinomial noise within each is drawn once for the step
    (the same size), which is much faster than one draw per sequence.
    """
    pairs = spec.tokens_per_step * spec.topk
    if spec.seq_len <= 1 or spec.seq_sigma == 0:
        return rng.multinomial(pairs, capped_shares(log_pop, spec.topk))
    full, rest = divmod(spec.tokens_per_step, spec.seq_len)
    lengths = np.array([spec.seq_len] * full + ([rest] if rest else []), dtype=np.float64)
    mixture = np.zeros(log_pop.shape)
    chunk = max(1, (1 << 22) // log_pop.size)  # sequences drawn at once, bounding memory
    for start in range(0, len(lengths), chunk):
        part = lengths[start : start + chunk]
        seq_pop = log_pop + spec.seq_sigma * rng.standard_normal((len(part), *log_pop.shape))
        mixture += np.einsum("s,sle->le", part, capped_shares(seq_pop, spec.topk))
    return rng.multinomial(pairs, mixture / lengths.sum())


def spec_meta(spec: WorkloadSpec) -> dict[str, Any]:
    """The meta dict a synthetic dump carries (the spec plus `source`)."""
    return {"source": "synthetic", **asdict(spec)}


# ---------------------------------------------------------------------------------------------------------
# Dump files
# ---------------------------------------------------------------------------------------------------------


def save_dump(path: str | Path, logical_count: np.ndarray | torch.Tensor, meta: dict | None = None) -> Path:
    """Write a recorder-format dump: .pt {logical_count: int64 tensor [T, L, E], meta}, .npz (same keys, meta as
    JSON) or .npy (the array only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.asarray(logical_count.cpu() if isinstance(logical_count, torch.Tensor) else logical_count)
    array = array.astype(np.int64, copy=False)
    if path.suffix == ".npy":
        np.save(path, array)
    elif path.suffix == ".npz":
        np.savez_compressed(path, logical_count=array, meta=np.array(json.dumps(dict(meta or {}))))
    else:
        torch.save({"logical_count": torch.from_numpy(array), "meta": dict(meta or {})}, path)
    return path


def load_dump(path: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    """Read logical_count int64 [T, L, E] and meta from a .pt (recorder dump), .npy or .npz file.

    A [L, E] array (one accumulated window) is read as one step.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dump at {path}")
    meta: dict[str, Any] = {}
    if path.suffix == ".npy":
        array = np.load(path)
    elif path.suffix == ".npz":
        with np.load(path) as data:
            keys = list(data.keys())
            if "meta" in data:
                meta = json.loads(str(data["meta"]))
            if "logical_count" in data:
                array = data["logical_count"]
            elif len(keys) == 1:
                array = data[keys[0]]
            else:
                raise ValueError(f"{path}: no 'logical_count' among the arrays {keys}")
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle errors come in many types
            raise ValueError(f"{path}: not a readable torch dump ({exc})") from exc
        if isinstance(obj, torch.Tensor):
            array = obj.numpy()
        elif isinstance(obj, dict) and "logical_count" in obj:
            array = torch.as_tensor(obj["logical_count"]).numpy()
            meta = dict(obj.get("meta") or {})
        else:
            raise ValueError(f"{path}: expected a dict with 'logical_count' [steps, layers, experts]")
    array = np.asarray(array)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3:
        raise ValueError(f"{path}: logical_count must be [steps, layers, experts], got shape {array.shape}")
    if (array < 0).any():
        raise ValueError(f"{path}: logical_count has negative entries")
    return array.astype(np.int64, copy=False), meta
