"""Reward tables from real runs, their file format, a synthetic stand-in, and planner replay.

A reward table holds, for every iteration of a training run, the rewards of the candidate seeds
explored for each prompt of that iteration's batch, in exploration order (candidate i is the i-th
seed the explorer would sample). Replaying a table asks "what would each planner have captured",
without a GPU: at each iteration every planner plans over that iteration's prompts, the captured
variance of a prompt is `captured_variance` of its first n candidates (n = 0: its first G seeds,
which are random seeds), and the planner then observes what the iteration revealed.

A table may also hold, for the same seeds, the rewards the explorers measured with stale weights
(`explored`, θ_{k-s} against the training rollout's θ_k). Replaying it is out of sample: each
group is chosen by its stale rewards and scored on its fresh ones, and the planners learn from
what they explored (stale) and from the unexplored prompts' rollouts (fresh), as they do in a
run (`spotlight.explore`). Without it the group is chosen and scored by the same rewards.

File formats (`load_reward_table`; `save_reward_table` writes either):

JSON::

    {"group_size": 8,                     # optional: the run's G
     "rewards": [                         # rewards[iteration][prompt][seed]
        {"one red circle": [0.0, 1.0, ...], "two blue squares": [...]},   # iteration 0
        ...]}

NPZ (numpy.savez; I iterations, P prompts, N candidates)::

    rewards         float (I, P, N)   rewards[i, p, s]; NaN inside the first num_candidates = failed reward
    prompts         str   (I, P)      prompt ids; "" pads an iteration with fewer than P prompts
    num_candidates  int   (I, P)      optional: valid candidates of each row (default N)
    group_size      int   ()          optional: the run's G
    explored        float (I, P, N)   optional: the same seeds' rewards under stale weights θ_{k-s}
    staleness       int   ()          optional: s

JSON holds the last two as "explored" (shaped like "rewards") and "staleness".

A prompt id may recur across iterations (a prompt drawn again in a later epoch); planners that
learn per prompt use that. `rewards` are those of the weights θ_k that the iteration's rollout
samples with (`benchmarks/record_reward_table.py`); only a table with `explored` measures the
drift between the stale and the fresh rankings as well as the planner.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planners.base import Observation, Planner
from planners.oracle import OraclePlanner
from planners.selection import captured_variance


@dataclass
class RewardTable:
    """Candidate rewards of every prompt of every iteration of a run."""

    iterations: list[dict[str, np.ndarray]]
    """iterations[k][prompt] = (N,) rewards of the prompt's candidates at iteration k."""
    group_size: int | None = None
    """The run's G, when the file records it."""
    source: str = ""
    """Where the table came from: a path, or "synthetic"."""
    explored: list[dict[str, np.ndarray]] | None = None
    """explored[k][prompt] = (N,) the same seeds' rewards under stale weights (what explorers see);
    None: the table is replayed in sample (groups chosen by the rewards they are scored on)."""
    staleness: int | None = None
    """s of the stale weights θ_{k-s} behind `explored`."""

    def __post_init__(self) -> None:
        if self.explored is None:
            return
        if len(self.explored) != len(self.iterations):
            raise ValueError(f"explored holds {len(self.explored)} iterations, rewards {len(self.iterations)}")
        for k, (fresh, stale) in enumerate(zip(self.iterations, self.explored)):
            if set(fresh) != set(stale):
                raise ValueError(f"iteration {k}: explored and rewards name different prompts")
            for p, r in fresh.items():
                if stale[p].shape != r.shape:
                    raise ValueError(
                        f"iteration {k}, prompt {p!r}: {stale[p].size} explored rewards for {r.size} candidates"
                    )

    def max_candidates(self, iteration: int) -> int:
        """Most candidates of any prompt at that iteration."""
        return max((r.size for r in self.iterations[iteration].values()), default=0)


def load_reward_table(path: str | Path) -> RewardTable:
    """Read a reward table from a .json or .npz file (format in the module docstring).

    Raises:
        ValueError: naming the file and what is wrong with it.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"reward table {str(path)!r} does not exist")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"reward table {path}: not valid JSON ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("rewards"), list):
            raise ValueError(f"reward table {path}: expected an object with a 'rewards' list of iterations")
        iterations = _json_iterations(path, data["rewards"], "rewards")
        group_size = data.get("group_size")
        explored = _json_iterations(path, data["explored"], "explored") if "explored" in data else None
        staleness = data.get("staleness")
    elif path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            for key in ("rewards", "prompts"):
                if key not in npz:
                    raise ValueError(f"reward table {path}: missing array {key!r} (has {sorted(npz.files)})")
            rewards, prompts = npz["rewards"].astype(np.float64), npz["prompts"].astype(str)
            if rewards.ndim != 3 or prompts.shape != rewards.shape[:2]:
                raise ValueError(
                    f"reward table {path}: rewards must be (I, P, N) and prompts (I, P); "
                    f"got {rewards.shape} and {prompts.shape}"
                )
            counts = npz["num_candidates"] if "num_candidates" in npz else np.full(prompts.shape, rewards.shape[2])
            group_size = int(npz["group_size"]) if "group_size" in npz else None
            stale = npz["explored"].astype(np.float64) if "explored" in npz else None
            staleness = int(npz["staleness"]) if "staleness" in npz else None
        if stale is not None and stale.shape != rewards.shape:
            raise ValueError(
                f"reward table {path}: explored must be shaped like rewards {rewards.shape}, got {stale.shape}"
            )

        def rows(values: np.ndarray) -> list[dict[str, np.ndarray]]:
            return [
                {str(p): values[k, j, : int(counts[k, j])] for j, p in enumerate(prompts[k]) if p}
                for k in range(values.shape[0])
            ]

        iterations = rows(rewards)
        explored = None if stale is None else rows(stale)
    else:
        raise ValueError(f"reward table {str(path)!r}: use a .json or .npz file")
    if not iterations:
        raise ValueError(f"reward table {path} holds no iterations")
    try:
        return RewardTable(
            iterations,
            None if group_size is None else int(group_size),
            str(path),
            explored,
            None if staleness is None else int(staleness),
        )
    except ValueError as err:
        raise ValueError(f"reward table {path}: {err}") from None


def _json_iterations(path: Path, values: object, key: str) -> list[dict[str, np.ndarray]]:
    """`values` (a JSON list of {prompt: rewards}) as arrays, or an error naming the file and key."""
    if not isinstance(values, list):
        raise ValueError(f"reward table {path}: {key!r} must be a list of iterations")
    iterations = []
    for k, it in enumerate(values):
        if not isinstance(it, dict):
            raise ValueError(f"reward table {path}: {key}[{k}] must map prompt ids to reward lists")
        try:
            iterations.append({str(p): np.asarray(r, dtype=np.float64).reshape(-1) for p, r in it.items()})
        except (TypeError, ValueError):
            raise ValueError(f"reward table {path}: {key}[{k}] holds a non-numeric reward list") from None
    return iterations


def save_reward_table(table: RewardTable, path: str | Path) -> None:
    """Write `table` as .json or .npz (by the suffix), readable by `load_reward_table`."""
    path = Path(path)
    if path.suffix == ".json":
        data: dict = {"rewards": [{p: r.tolist() for p, r in it.items()} for it in table.iterations]}
        if table.group_size is not None:
            data["group_size"] = table.group_size
        if table.explored is not None:
            data["explored"] = [
                {p: it[p].tolist() for p in fresh} for fresh, it in zip(table.iterations, table.explored)
            ]
        if table.staleness is not None:
            data["staleness"] = table.staleness
        path.write_text(json.dumps(data))
    elif path.suffix == ".npz":
        num_p = max(len(it) for it in table.iterations)
        num_n = max(table.max_candidates(k) for k in range(len(table.iterations)))
        rewards = np.full((len(table.iterations), num_p, num_n), np.nan)
        stale = np.full_like(rewards, np.nan)
        prompts = np.full((len(table.iterations), num_p), "", dtype=object)
        counts = np.zeros((len(table.iterations), num_p), dtype=np.int64)
        for k, it in enumerate(table.iterations):
            for j, (p, r) in enumerate(it.items()):
                rewards[k, j, : r.size], prompts[k, j], counts[k, j] = r, p, r.size
                if table.explored is not None:
                    stale[k, j, : r.size] = table.explored[k][p]
        extra = {} if table.group_size is None else {"group_size": np.int64(table.group_size)}
        if table.explored is not None:
            extra["explored"] = stale
        if table.staleness is not None:
            extra["staleness"] = np.int64(table.staleness)
        np.savez(path, rewards=rewards, prompts=prompts.astype(str), num_candidates=counts, **extra)
    else:
        raise ValueError(f"reward table {str(path)!r}: use a .json or .npz file")


def synthetic_reward_table(
    *,
    seed: int = 0,
    num_iterations: int = 60,
    pool_size: int = 96,
    prompts_per_iteration: int = 24,
    num_candidates: int = 64,
    group_size: int = 8,
) -> RewardTable:
    """A non-stationary stand-in for a real run's table (for tests and a first benchmark figure).

    A pool of prompts, `prompts_per_iteration` of them drawn per iteration (so prompts recur).
    Each prompt has a success probability p_k = sigmoid(a + b k) that the policy improves at its
    own rate b (some never, some saturate within the run); rewards are Bernoulli(p_k) (a
    verifier, GenEval-like) for 60% of prompts, and Beta with mean p_k and a per-prompt
    concentration (a reward model) for the rest.
    """
    rng = np.random.default_rng(seed)
    start = rng.normal(-1.0, 1.5, pool_size)
    rate = rng.uniform(0.0, 0.12, pool_size) * (rng.random(pool_size) < 0.8)
    binary = rng.random(pool_size) < 0.6
    concentration = rng.uniform(2.0, 20.0, pool_size)
    iterations = []
    for k in range(num_iterations):
        chosen = np.sort(rng.choice(pool_size, size=prompts_per_iteration, replace=False))
        it = {}
        for i in chosen:
            p = 1.0 / (1.0 + math.exp(-(start[i] + rate[i] * k)))
            if binary[i]:
                r = (rng.random(num_candidates) < p).astype(np.float64)
            else:
                p = min(max(p, 1e-3), 1 - 1e-3)
                r = rng.beta(p * concentration[i], (1 - p) * concentration[i], num_candidates)
            it[f"prompt-{i:03d}"] = r
        iterations.append(it)
    return RewardTable(iterations, group_size, "synthetic")


@dataclass
class ReplayResult:
    """What each planner captured on a replayed table."""

    captured: dict[str, float]
    """Planner name -> variance captured, summed over prompts and iterations."""
    per_iteration: dict[str, list[float]]
    """Planner name -> captured variance of each iteration."""
    zero_variance_groups: dict[str, int]
    """Planner name -> groups that carried no signal (all rewards equal)."""
    samples_spent: dict[str, int]
    """Planner name -> candidates allocated over the run."""
    budget_samples: list[int] = field(default_factory=list)
    """Exploration budget of each iteration, in samples."""


def replay(
    table: RewardTable,
    planners: Mapping[str, Planner],
    *,
    group_size: int,
    budget_fraction: float,
    oracle: bool = True,
    in_sample: bool = False,
) -> ReplayResult:
    """Replay `table` with every planner (and the hindsight oracle as "oracle").

    Budget of iteration k: floor(budget_fraction * P_k * N_k) samples (P_k prompts, N_k the most
    candidates of a prompt); no planner may give a prompt more than N_k. After planning, each
    planner observes, per prompt, the candidates it explored, or for an unexplored prompt its
    first G seeds (the rollout group of random seeds) -- what the iteration reveals in training.

    With `table.explored` (and `in_sample` False) the replay is out of sample: groups are chosen
    by the explored (stale) rewards and scored on the fresh ones, explored candidates are observed
    with their stale rewards and unexplored prompts with their rollout's fresh ones. The oracle
    keeps hindsight: it allocates and selects by the fresh rewards, the bound a stale planner
    approaches.

    Args:
        table: the reward table.
        planners: name -> planner (the replay changes them through `observe`).
        group_size: G.
        budget_fraction: exploration budget as a fraction of exploring every candidate.
        oracle: add the hindsight `OraclePlanner` under the name "oracle".
        in_sample: ignore `table.explored` (choose and score groups by the same rewards).
    """
    if not 0 <= budget_fraction <= 1:
        raise ValueError(f"budget_fraction must be in [0, 1], got {budget_fraction}")
    names = list(planners) + (["oracle"] if oracle else [])
    if oracle and "oracle" in planners:
        raise ValueError("pass oracle=False to supply your own planner named 'oracle'")
    result = ReplayResult(
        captured=dict.fromkeys(names, 0.0),
        per_iteration={n: [] for n in names},
        zero_variance_groups=dict.fromkeys(names, 0),
        samples_spent=dict.fromkeys(names, 0),
    )
    explored = None if in_sample else table.explored
    for k, rewards in enumerate(table.iterations):
        stale = rewards if explored is None else explored[k]
        prompts = list(rewards)
        max_n = table.max_candidates(k)
        # With G or fewer candidates per prompt there is nothing to choose from.
        budget = math.floor(budget_fraction * len(prompts) * max_n) if max_n > group_size else 0
        result.budget_samples.append(budget)
        cap = max_n if max_n > group_size else None
        for name in names:
            planner = OraclePlanner(rewards) if name == "oracle" else planners[name]
            alloc = planner.plan(prompts, budget, group_size=group_size, max_candidates=cap)
            by = rewards if name == "oracle" else stale
            values = [captured_variance(rewards[p], alloc[p], group_size, selected_by=by[p]) for p in prompts]
            result.per_iteration[name].append(float(sum(values)))
            result.captured[name] += float(sum(values))
            result.zero_variance_groups[name] += sum(v == 0.0 for v in values)
            result.samples_spent[name] += alloc.total()
            if name != "oracle":
                planner.observe(
                    [
                        Observation(p, stale[p][: alloc[p]] if alloc[p] else rewards[p][:group_size], iteration=k)
                        for p in prompts
                    ]
                )
    return result
