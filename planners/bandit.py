"""The bandit planner: spend the exploration budget where selection adds the most reward variance.

The Spotlight paper does not publish its planner (docs/architecture.md, "Seed exploration"); this is our design.

Arms and value. An arm is a prompt; pulling it with n candidate seeds lets `select_contrast`
("extremes": top ceil(G/2), bottom floor(G/2)) pick the group from n draws instead of using G
random seeds. Its value is what that adds to the group's reward variance, the GRPO signal:

    gain_p(n) = E[var(extremes of n draws from F_p)] - E[var(G draws from F_p)],   n >= G + 1,

with F_p the distribution of prompt p's reward over seeds under the current weights. The gain
depends on the shape of F_p, not only on its variance: a prompt that succeeds one time in ten
gains most (random groups often miss the rare success, 64 candidates almost never do), while a
prompt at 50/50 already has variance in a random group and gains little.

Model of F_p. Rewards are mapped to [0, 1] (`reward_range`) and F_p is the Beta distribution with
mean mu_p and variance phi_p mu_p (1 - mu_p). The dispersion phi in (0, 1] sets the shape: 1 is
a 0/1 verifier (Bernoulli), 1/3 the uniform distribution, small a reward model's concentrated
scores. Splitting mean and shape matters for rare successes: a prompt seen 0 out of 8 times has
a low mean, not a low dispersion, so it stays a candidate for exploration (a model of mean and
variance alone would call it saturated).

Estimates. From a prompt's discounted sums of weights W, rewards and squared rewards: the mean
(k m0 + sum x) / (k + W), shrunk towards the prior mean m0 by k = `prior_strength`
pseudo-rewards; the dispersion by a ratio estimate, squared deviations over what phi = 1 would
give, (k/4 phi0 + SS) / (k/4 + W mu (1 - mu)), so that all-equal rewards at a mean near 0 or 1
are weak evidence of a small phi, and all-equal rewards at a mean near 1/2 strong evidence.

Prior and unseen prompts. In real runs prompts recur rarely (the tiny recipe draws 8 of 1,768
per iteration), so many prompts are unseen. Their prior (m0, phi0) is learned from every
observation (empirical Bayes): the discounted mean reward and pooled dispersion of the prompt's
family (`family(prompt)`, default: all prompts form one family; `planners.families` builds
them from a recipe's `explore.planner_family`), shrunk in turn towards the uniform distribution
(m0 = 1/2, phi0 = 1/3).

Exploration. Thompson sampling (Thompson 1933; with discounting, Raj & Kalyani 2017): each plan
draws mu_p from Beta(mu W', (1 - mu) W') with W' = (k + W) / phi (W rewards of dispersion phi
say as much about the mean as W / phi Bernoulli trials; for phi = 1 this is the conjugate
Beta-Bernoulli posterior) and values the prompt as if the draw were true. A prompt with little
evidence draws widely and sometimes wins budget; a prompt observed saturated draws a mean near
0 or 1 and gets little. The draws come from a generator seeded by (seed, prompt ids, latest
iteration observed), so plans are reproducible.

Expected selected variance. Seeded Monte Carlo with common random numbers: M rows of uniforms
U (M, n_max), and for each grid count n the uniforms of the extremes of the first n columns,
(J, M, G). As the Beta quantile function Q_p is increasing, the extremes of n draws from F_p are
Q_p of the extreme uniforms, so one set of selected uniforms serves every prompt: per prompt the
cost is one Q_p table (scipy's betaincinv at 129 levels, denser at the tails) and an
interpolation. The same uniforms for every prompt and count keep the comparison between them free
of Monte Carlo noise in the ranking's first order.

Allocation. Counts are valued on a grid n in {G + 1, ..., cap} (about `grid_points` values).
For each prompt, take the upper concave hull of (0, 0) and its (n, gain_p(n)); then spend samples
on hull segments in decreasing order of gain per sample, across prompts (ties: prompt order).
For concave separable gains this greedy is optimal for the continuous relaxation (the
fractional knapsack on the hull; Ibaraki & Katoh, "Resource Allocation Problems", 1988), and the
hull handles the S-shaped start of rare-success prompts whose first few candidates gain little.
Integer effects lose at most the last partial segment: a segment that does not fit is taken in
part (but a prompt is entered only with at least G + 1), and smaller segments then fill what is
left. Extremes of more draws have diminishing returns (the expected maximum of n draws grows
like a quantile 1 - 1/n), so gains are nearly concave and the hull loses little.

Cost. Every candidate costs `cost_per_sample` (the explorer's seconds per sampled and scored
seed); the budget (e.g. the predicted training-step time times the spot workers) buys
floor(budget / cost) candidates.

Non-stationarity. The policy improves and prompts saturate, so an observation made at iteration
t weighs `discount` ** (now - t) (now = the latest iteration observed), in the prompt's and the
family's sums alike. Old evidence fades to the prior at a half-life of log(0.5) / log(discount)
iterations (6.6 at the default 0.9, which did better than 0.95 on every synthetic table we tried;
re-tune on real tables). The memory is also a floor on certainty: a prompt holds at most
1 / (1 - discount) iterations' worth of evidence, so a verifier prompt that has succeeded every
time keeps a small belief in a rare failure and a small gain; it gets budget only when prompts
with more to gain are full (`max_candidates`) or absent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from planners.base import Observation, Planner, plan_rng

# Quantile levels for the Beta tables: dense near 0 and 1, where the extremes of many draws fall.
_LEVELS = 0.5 - 0.5 * np.cos(np.pi * np.linspace(0.0, 1.0, 129))
_UNINFORMED_MEAN, _UNINFORMED_DISPERSION = 0.5, 1.0 / 3.0  # uniform on [0, 1]: variance 1/12 = 1/3 * 1/4
_MIN_VAR = 1e-10  # below this a prompt is saturated: nothing to gain


class BanditPlanner(Planner):
    """Thompson-sampling planner over prompts, valued by expected selected-group variance.

    Args:
        seed: seeds the posterior draws and the Monte Carlo.
        discount: weight factor per iteration of age of an observation (0 < discount <= 1).
        prior_strength: pseudo-samples of the family prior in a prompt's posterior (> 0).
        num_draws: Monte Carlo rows M for the expected selected variance.
        grid_points: about how many candidate counts per prompt are valued.
        reward_range: (low, high) of the reward; rewards are mapped to [0, 1] and clipped.
        family: prompt id -> family key; prompts of a family share a prior (e.g. a GenEval tag).
            None: one family.
    """

    name = "bandit"

    def __init__(
        self,
        seed: int = 0,
        *,
        discount: float = 0.9,
        prior_strength: float = 4.0,
        num_draws: int = 64,
        grid_points: int = 32,
        reward_range: tuple[float, float] = (0.0, 1.0),
        family: Callable[[str], str] | None = None,
    ) -> None:
        super().__init__(seed)
        if not 0 < discount <= 1:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        if not prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        if num_draws < 1 or grid_points < 1:
            raise ValueError(f"num_draws and grid_points must be >= 1, got {num_draws} and {grid_points}")
        low, high = (float(x) for x in reward_range)
        if not high > low:
            raise ValueError(f"reward_range must be (low, high) with high > low, got {reward_range}")
        self.discount, self.prior_strength = float(discount), float(prior_strength)
        self.num_draws, self.grid_points = int(num_draws), int(grid_points)
        self.reward_range = (low, high)
        self.family = family
        self._now = -1  # latest iteration observed
        self._prompts: dict[str, list[float]] = {}  # prompt -> [W, sum w x, sum w x^2, t]
        # family -> [sum w n, sum w x, sum w (n - 1) xbar (1 - xbar), sum w SS, t] over observations
        self._families: dict[str, list[float]] = {}

    # -- learning -------------------------------------------------------------------------------

    def observe(self, observations: Sequence[Observation]) -> None:
        low, high = self.reward_range
        for obs in observations:
            if obs.iteration < 0:
                raise ValueError(f"observation iteration must be >= 0, got {obs.iteration} for {obs.prompt!r}")
            x = np.asarray(obs.rewards, dtype=np.float64).reshape(-1)
            x = np.clip((x[~np.isnan(x)] - low) / (high - low), 0.0, 1.0)
            if x.size == 0:
                continue
            self._now = max(self._now, int(obs.iteration))
            stats = self._prompts.setdefault(obs.prompt, [0.0, 0.0, 0.0, float(obs.iteration)])
            w = self._age(stats, obs.iteration)
            stats[0] += w * x.size
            stats[1] += w * float(x.sum())
            stats[2] += w * float((x * x).sum())
            fam = self._families.setdefault(self._family(obs.prompt), [0.0, 0.0, 0.0, 0.0, float(obs.iteration)])
            w = self._age(fam, obs.iteration)
            fam[0] += w * x.size
            fam[1] += w * float(x.sum())
            fam[2] += w * (x.size - 1) * float(x.mean() * (1 - x.mean()))
            fam[3] += w * float(((x - x.mean()) ** 2).sum())
        # Forget prompts whose evidence has decayed to nothing (bounded state over long runs).
        stale = [p for p, s in self._prompts.items() if s[0] * self.discount ** (self._now - s[-1]) < 1e-6]
        for p in stale:
            del self._prompts[p]

    def _age(self, stats: list[float], iteration: int) -> float:
        """Decay `stats` (last entry: its iteration) to `iteration` if newer; the new data's weight."""
        if iteration >= stats[-1]:
            factor = self.discount ** (iteration - stats[-1])
            stats[:-1] = [v * factor for v in stats[:-1]]
            stats[-1] = float(iteration)
            return 1.0
        return self.discount ** (stats[-1] - iteration)  # a late observation of an older iteration

    def _family(self, prompt: str) -> str:
        return "" if self.family is None else str(self.family(prompt))

    def _posterior(self, prompt: str) -> tuple[float, float, float]:
        """(mean, dispersion, effective trials) of the prompt's reward distribution, in [0, 1] units.

        The dispersion phi = variance / (mean (1 - mean)) is 1 for a 0/1 verifier, 1/3 for the
        uniform distribution, small for a concentrated reward-model score. W rewards of
        dispersion phi tell as much about the mean as W / phi Bernoulli trials.
        """
        k = self.prior_strength
        fam = self._families.get(self._family(prompt))
        m0, phi0 = _UNINFORMED_MEAN, _UNINFORMED_DISPERSION
        if fam is not None:
            d = self.discount ** (self._now - fam[-1])
            m0 = (k * m0 + d * fam[1]) / (k + d * fam[0])
            phi0 = (k * 0.25 * phi0 + d * fam[3]) / (k * 0.25 + d * fam[2])
        stats = self._prompts.get(prompt)
        if stats is None:
            return m0, phi0, k / phi0
        d = self.discount ** (self._now - stats[-1])
        w, s1, s2 = d * stats[0], d * stats[1], d * stats[2]
        mean = (k * m0 + s1) / (k + w)
        # Ratio estimate of phi: squared deviations over what phi = 1 would give. All-equal rewards
        # at a mean near 0 or 1 are weak evidence of a small phi (a rare success is just unseen),
        # so the prior is worth k rewards at mean 1/2, and the data w rewards at their own mean.
        within = max(s2 - s1 * s1 / w, 0.0) if w > 0 else 0.0
        phi = (k * 0.25 * phi0 + within) / (k * 0.25 + w * mean * (1 - mean))
        phi = min(max(phi, 1e-6), 1.0)
        return mean, phi, (k + w) / phi

    # -- planning -------------------------------------------------------------------------------

    def _allocate(self, prompts: list[str], num_samples: int, group_size: int, cap: int) -> dict[str, int]:
        rng = plan_rng(self.seed, prompts, self._now + 1)
        mean_P, var_P = np.empty(len(prompts)), np.empty(len(prompts))
        for i, p in enumerate(prompts):
            mean, phi, trials = self._posterior(p)
            mean = rng.beta(mean * trials, (1 - mean) * trials)
            mean_P[i] = min(max(mean, 1e-4), 1 - 1e-4)
            var_P[i] = min(phi, 0.999) * mean_P[i] * (1 - mean_P[i])
        step = max(1, math.ceil((cap - group_size - 1) / self.grid_points))
        counts_J = np.unique(np.r_[group_size, np.arange(group_size + 1, cap + 1, step), cap])
        sel_JMG = selected_uniforms(rng, counts_J, group_size, self.num_draws)
        value_PJ = expected_selected_variance(mean_P, var_P, sel_JMG)
        gain_PK = value_PJ[:, 1:] - value_PJ[:, :1]
        return concave_allocation(prompts, counts_J[1:], gain_PK, num_samples, group_size)

    # -- checkpointing --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "now": self._now,
            "prompts": {p: list(s) for p, s in self._prompts.items()},
            "families": {f: list(s) for f, s in self._families.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._now = int(state["now"])
        self._prompts = {p: [float(v) for v in s] for p, s in state["prompts"].items()}
        self._families = {f: [float(v) for v in s] for f, s in state["families"].items()}


def selected_uniforms(rng: np.random.Generator, counts_J: np.ndarray, group_size: int, num_draws: int) -> np.ndarray:
    """(J, M, G) uniforms selected by "extremes" from the first counts_J[j] of M rows of uniforms.

    counts_J[j] == G selects all G (a random group). Within a row the selected values are not
    sorted (only their set matters for a variance).
    """
    n_max = int(counts_J.max())
    u_MN = rng.random((num_draws, n_max))
    num_bottom = group_size // 2
    num_top = group_size - num_bottom
    out = np.empty((len(counts_J), num_draws, group_size))
    for j, n in enumerate(counts_J.tolist()):
        if n == group_size:
            out[j] = u_MN[:, :n]
            continue
        # After partitioning at these two ranks, the first num_bottom are the smallest and the
        # last num_top the largest of the row: O(n) instead of a sort.
        part = np.partition(u_MN[:, :n], [num_bottom - 1, n - num_top], axis=1)
        out[j, :, :num_bottom] = part[:, :num_bottom]
        out[j, :, num_bottom:] = part[:, n - num_top :]
    return out


def expected_selected_variance(mean_P: np.ndarray, var_P: np.ndarray, sel_JMG: np.ndarray) -> np.ndarray:
    """(P, J) Monte Carlo mean of the population variance of Q_p(selected uniforms).

    Q_p is the quantile function of the Beta distribution with mean mean_P[p] and variance
    var_P[p] (in [0, 1]); prompts with variance below 1e-10 get 0.
    """
    out = np.zeros((len(mean_P), sel_JMG.shape[0]))
    live = var_P > _MIN_VAR
    if not live.any():
        return out
    # Imported here: scipy.special takes ~0.25 s to import, and `spotlight.config` imports `planners`
    # (to check explore.planner_family) for every command, most of which never plan.
    from scipy.special import betaincinv

    m, v = mean_P[live], var_P[live]
    nu = np.minimum(m * (1 - m) / v - 1, 1e7)  # Beta(a, b): a + b = nu
    q_PL = betaincinv((m * nu)[:, None], ((1 - m) * nu)[:, None], _LEVELS[None, :])
    idx = np.clip(np.searchsorted(_LEVELS, sel_JMG, side="right"), 1, len(_LEVELS) - 1)
    frac = (sel_JMG - _LEVELS[idx - 1]) / (_LEVELS[idx] - _LEVELS[idx - 1])
    rows = np.flatnonzero(live)
    for r, q_L in zip(rows.tolist(), q_PL, strict=True):
        x_JMG = q_L[idx - 1] + frac * (q_L[idx] - q_L[idx - 1])
        out[r] = x_JMG.var(axis=2).mean(axis=1)
    return out


def concave_allocation(
    prompts: Sequence[str], counts_K: np.ndarray, gain_PK: np.ndarray, num_samples: int, group_size: int
) -> dict[str, int]:
    """Greedy allocation on the upper concave hulls of (0, 0) and (counts_K, gain_PK[p]).

    Segments of all hulls are taken in decreasing gain per sample (ties: prompt order, then
    count); a segment that does not fit is taken in part, and a prompt is entered only with at
    least G + 1 candidates. Segments with no gain are never bought.
    """
    segments = []
    xs = [0, *counts_K.tolist()]
    for i, gains in enumerate(gain_PK):
        hull: list[tuple[int, float]] = []
        for point in zip(xs, [0.0, *gains.tolist()], strict=True):
            # Pop while the last hull point lies on or under the chord to the new point.
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], point) >= 0:
                hull.pop()
            hull.append(point)
        for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
            slope = (y1 - y0) / (x1 - x0)
            if slope <= 0:
                break
            segments.append((-slope, i, x0, x1))
    segments.sort()
    counts = [0] * len(prompts)
    left = num_samples
    for _, i, x0, x1 in segments:
        if left == 0:
            break
        if counts[i] != x0:  # an earlier segment of this prompt was skipped or cut short
            continue
        take = min(left, x1 - x0)
        if x0 == 0 and take <= group_size:
            continue
        counts[i] += take
        left -= take
    return {p: n for p, n in zip(prompts, counts, strict=True) if n}


def _cross(o: tuple[int, float], a: tuple[int, float], b: tuple[int, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
