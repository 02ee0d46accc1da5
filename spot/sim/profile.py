"""Profiles: how long each phase of an RL post-training iteration takes, for the simulator.

A profile is per-phase durations and a few facts about the cluster, enough to replay a run in
virtual time. Three sources:

    builtin_profile("qwen-image-512")     paper scale, from the assumptions written beside each value
    builtin_profile("qwen-image-1280")
    profile_from_run(RUN_DIR)             measured: the `time/*` columns of a real run's metrics.jsonl
    load_profile(PATH)                    a YAML/JSON file of `Profile` fields (e.g. a calibration)

Units: seconds of one worker (one GPU, or one sequence-parallel group of `sp_degree` GPUs) unless a
field says GPU-seconds. A *job* is one micro-batch of `samples_per_job` trajectories sampled
together; `job_step_s` is one denoising step of one job on one worker of `sp_degree` GPUs.

The learning model (what exploration buys) is not a duration: see `spot.sim.learning`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from spotlight.core.files import read_jsonl

# The trainer writes its per-iteration metrics here (`spotlight.core.tracking.METRICS_FILE`). spot sits
# below spotlight and may not import it, so the name is repeated; tests/test_simulator.py checks both agree.
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class Profile:
    """Per-phase durations of one iteration and the cluster facts the simulator needs."""

    name: str
    """What this profile describes."""
    prompts_per_iteration: int
    """P, prompts per training iteration."""
    group_size: int
    """G, samples per prompt."""
    num_steps: int
    """Denoising steps of one rollout trajectory."""
    samples_per_job: int
    """Trajectories sampled together as one job (the micro-batch)."""
    job_step_s: float
    """One denoising step of one job on one worker of `sp_degree` GPUs, seconds."""
    reward_gpu_s_per_sample: float
    """Scoring one sample, GPU-seconds (on the trainer GPUs after the rollout; explorers score their own)."""
    update_gpu_s: float
    """The policy update of one iteration, GPU-seconds; split over the trainer GPUs (data parallel)."""
    iterations_to_target: int
    """Iterations plain GRPO (random seeds) needs to reach the target score."""
    explore_steps: int | None = None
    """Denoising steps of an exploration candidate (None: `num_steps`)."""
    weight_sync_s: float = 5.0
    """After an update, the time until spot workers hold the new weights."""
    node_startup_s: float = 150.0
    """From a spot node's arrival until its worker is ready (boot, model load)."""
    detect_s: float = 4.0
    """From a node vanishing without notice until the scheduler declares its worker lost."""
    poll_s: float = 1.0
    """A free worker's wait between pulls when the queue has nothing for it."""
    commit_every: int = 2
    """m: a job commits its state every m steps (and on a notice)."""
    sp_degree: int = 1
    """GPUs per worker (sequence-parallel degree)."""
    min_sp_degree: int = 1
    """The fewest GPUs a worker can run on (memory); an elastic group shrinks no further."""
    sp_scaling: float = 0.9
    """A group of d GPUs steps d**sp_scaling times faster than one GPU."""
    reform_s: float = 1.0
    """Elastic SP: survivors re-form a group this long after a member is lost (persistent workers)."""
    cold_restart_s: float = 90.0
    """Non-elastic SP: survivors restart their processes and reload the model."""
    selection_iterations_ratio: float = 1.667
    """Measured learning model: plain GRPO's iterations to the target over those of GRPO whose every
    prompt trains on the contrast group of a full pool of candidates scored with the fresh weights
    (the oracle of benchmarks/time_to_target.py; its pool is the reward table's candidates per
    prompt, 4 G). 1.667 (range 1.667-1.833) over 3 training seeds on the tiny recipe with 64
    candidates per prompt (docs/tiny-recipe-notes.md, sixteenth session). 1: selection does not help."""
    stale_gain_share: float = 1.0
    """Measured learning model: the share of that gain kept when the candidates were scored with the
    weights of one iteration before (spot explorers during the update): stale selection with 4
    emulated nodes over the oracle, (1.667 - 1) / (1.667 - 1) = 1.0 on the same 3 seeds."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self):
        for f in (
            "prompts_per_iteration",
            "group_size",
            "num_steps",
            "samples_per_job",
            "iterations_to_target",
            "commit_every",
            "sp_degree",
            "min_sp_degree",
        ):
            if getattr(self, f) < 1:
                raise ValueError(f"profile {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        for f in ("job_step_s",):
            if not getattr(self, f) > 0:
                raise ValueError(f"profile {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        for f in (
            "reward_gpu_s_per_sample",
            "update_gpu_s",
            "weight_sync_s",
            "node_startup_s",
            "detect_s",
            "reform_s",
            "cold_restart_s",
        ):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"profile {self.name!r}: {f} must be a finite number >= 0, got {v}")
        if not self.poll_s > 0:
            raise ValueError(f"profile {self.name!r}: poll_s must be > 0, got {self.poll_s}")
        if self.min_sp_degree > self.sp_degree:
            raise ValueError(f"profile {self.name!r}: min_sp_degree {self.min_sp_degree} > sp_degree {self.sp_degree}")
        if not (math.isfinite(self.selection_iterations_ratio) and self.selection_iterations_ratio > 0):
            raise ValueError(
                f"profile {self.name!r}: selection_iterations_ratio must be a finite number > 0, "
                f"got {self.selection_iterations_ratio}"
            )
        if not 0 <= self.stale_gain_share <= 1:
            raise ValueError(f"profile {self.name!r}: stale_gain_share must be in [0, 1], got {self.stale_gain_share}")
        if self.group_size < 2:
            raise ValueError(f"profile {self.name!r}: group_size must be >= 2, got {self.group_size}")

    @property
    def steps_per_candidate(self) -> int:
        return self.explore_steps or self.num_steps

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.group_size

    def step_s(self, gpus: int, speed: float = 1.0) -> float:
        """One job step on a worker of `gpus` GPUs (relative `speed`), from the `sp_degree` figure."""
        return self.job_step_s * (self.sp_degree / gpus) ** self.sp_scaling / speed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Paper-scale profiles. Every value is an assumption stated beside it; change them in a profile
# file (`spotlight simulate --profile FILE`), or measure them (`profile_from_run`).
_QWEN_IMAGE_512 = dict(
    name="qwen-image-512",
    # Flow-GRPO-style OCR recipe at 512x512: 16 prompts x group 16 per iteration (the recorded reward
    # table's shape), 10 sampling steps with windowed SDE, jobs of 4 images.
    prompts_per_iteration=16,
    group_size=16,
    num_steps=10,
    samples_per_job=4,
    # One step of the 20B DiT on 4 images with true CFG (8 sequences of 1024 image + ~128 text tokens):
    # 2 x 20e9 x 1152 x 8 ~ 3.7e14 FLOP; at ~400 TFLOP/s sustained bf16 on an H100-class GPU, ~0.9 s.
    job_step_s=0.9,
    # An OCR reader per image, ~0.05 s.
    reward_gpu_s_per_sample=0.05,
    # Windowed SDE trains 3 of the 10 steps per sample: forward + backward ~3x a forward, with CFG:
    # 3 steps x 3 x 0.9 s / 4 images ~ 2 GPU-s per sample, x 256 samples.
    update_gpu_s=518.0,
    # Flow-GRPO's OCR runs reach their plateau after some hundreds of iterations; the ratios the
    # simulator reports depend on this only through how much of a trace the run spans.
    iterations_to_target=300,
    # LoRA rank 64 weights are ~0.3 GB: seconds to publish and fetch.
    weight_sync_s=5.0,
    # A spot instance boots (~60 s) and loads ~40 GB of bf16 weights (~90 s).
    node_startup_s=150.0,
    # Ray's health checks tuned as in docs/spot.md (1 s period, 2 misses): ~4 s.
    detect_s=4.0,
    poll_s=1.0,
    commit_every=2,
    sp_degree=1,
    min_sp_degree=1,
    # The learning model is the one measured on the tiny recipe (selection_iterations_ratio,
    # stale_gain_share: their defaults); whether a Qwen-Image OCR run gains as much per iteration
    # from a 64-candidate pool is not known: simulate_paper.py's sensitivity table varies it.
    source="paper-scale assumptions (spot/sim/profile.py)",
)

_QWEN_IMAGE_1280 = dict(
    _QWEN_IMAGE_512,
    name="qwen-image-1280",
    # GenEval-style recipe at 1280x1280: 6400 image tokens. Linear layers scale 6.25x; attention, now
    # a larger share, brings a step on one GPU to ~7.3 s; sequence parallel over 4 GPUs (Ulysses).
    job_step_s=2.1,
    sp_degree=4,
    # Activations of 4 images at 6400 tokens do not fit one 80 GB GPU next to 40 GB of weights.
    min_sp_degree=2,
    sp_scaling=0.9,
    # A GenEval detector per image.
    reward_gpu_s_per_sample=0.1,
    # 3 trained steps x 3 x 7.3 s / 4 images ~ 16 GPU-s per sample, x 256.
    update_gpu_s=4200.0,
    # Elastic SP re-forms from state on the nodes (measured 0.13 s on CPU, benchmarks/sp_reform.py);
    # 1 s leaves room for NCCL communicator set-up. A cold restart reloads the model.
    reform_s=1.0,
    cold_restart_s=90.0,
)

BUILTIN = {"qwen-image-512": _QWEN_IMAGE_512, "qwen-image-1280": _QWEN_IMAGE_1280}


def builtin_profile(name: str) -> Profile:
    if name not in BUILTIN:
        raise ValueError(f"unknown profile {name!r}; built-in profiles: {', '.join(BUILTIN)}, or a YAML/JSON file")
    return Profile(**BUILTIN[name])


def profile_from_dict(doc: dict, *, where: str) -> Profile:
    """A profile from a mapping of `Profile` fields (`base: NAME` starts from a built-in profile);
    unknown or missing fields name themselves."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: a profile is a mapping of fields, got {type(doc).__name__}")
    valid = [f.name for f in fields(Profile)]
    doc = dict(doc)
    base_name = doc.pop("base", None)  # start from a built-in profile and change some fields
    if base_name is not None and base_name not in BUILTIN:
        raise ValueError(f"{where}: base {base_name!r} is not a built-in profile ({', '.join(BUILTIN)})")
    for key in doc:
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=1)
            raise ValueError(
                f"{where}: unknown profile field {key!r}" + (f"; did you mean {near[0]!r}?" if near else "")
            )
    base = dict(BUILTIN[base_name]) if base_name else {}
    try:
        return Profile(**{**base, **doc})
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from None


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name, or a YAML/JSON file of `Profile` fields."""
    if name_or_path in BUILTIN:
        return builtin_profile(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"profile {name_or_path!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file")
    try:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file (byte {e.start} is not UTF-8); a profile is YAML or JSON") from None
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a valid profile ({str(e).splitlines()[0]})") from None
    return profile_from_dict(doc, where=str(path))


def profile_from_run(run_dir: str | Path, *, trainer_gpus: int = 1, name: str | None = None) -> Profile:
    """A profile measured from a real run: medians of its per-iteration `time/*` columns.

    The run's recipe gives P, G, the steps and the batch; its metrics give rollout, reward and update
    seconds (iterations after the first, which pays warm-up). The rollout ran all P x G samples as
    one job per trainer process, so `job_step_s` is rollout seconds over steps with
    `samples_per_job` = P x G / trainer_gpus. The learning facts (iterations to target, what
    selection saves) are not in one run's metrics: they keep the defaults, measured over several
    runs by benchmarks/time_to_target.py (`--set` changes them).
    """
    import statistics

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ValueError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = yaml.safe_load(cfg_path.read_text())
    rows = [r for r in read_jsonl(run_dir / METRICS_FILE) if "time/rollout_s" in r]
    if len(rows) < 2:
        raise ValueError(f"{run_dir}: needs at least 2 iterations with time/* metrics, found {len(rows)}")
    rows = rows[1:]

    def med(key: str) -> float:
        vals = [r[key] for r in rows if key in r]
        if not vals:
            raise ValueError(f"{run_dir}: {METRICS_FILE} has no {key!r}")
        return float(statistics.median(vals))

    train, sample = cfg["train"], cfg["sample"]
    num_prompts, group = int(train["prompts_per_iteration"]), int(train["group_size"])
    steps = int(sample["num_steps"])
    per_job = max(1, num_prompts * group // trainer_gpus)
    return Profile(
        name=name or f"measured:{run_dir.name}",
        prompts_per_iteration=num_prompts,
        group_size=group,
        num_steps=steps,
        samples_per_job=per_job,
        job_step_s=med("time/rollout_s") / steps,
        reward_gpu_s_per_sample=med("time/reward_s") * trainer_gpus / (num_prompts * group),
        update_gpu_s=med("time/update_s") * trainer_gpus,
        iterations_to_target=max(1, len(rows) + 1),
        source=f"measured from {run_dir} ({len(rows)} iterations)",
    )
