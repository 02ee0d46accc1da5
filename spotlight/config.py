"""The DiT GRPO recipe: typed dataclasses, the single source of truth for every setting.

The defaults are the embedded CPU recipe (`configs/dit/tiny-shapes.yaml` spells the same values
out): post-train the shipped tiny shapes base model on 2 CPU cores in about ten minutes. YAML
recipes override these defaults and dotted command-line overrides (`train.lr=3e-4`) override the
recipe (see `config_io.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from planners.families import prompt_family
from spotlight.core.config import LogSettings, TrainSettings
from spotlight.core.cost import CostConfig


@dataclass
class ModelConfig:
    """Which model to post-train and how."""

    path: str = ""
    """Qwen-Image model folder (diffusers layout); empty = the tiny shapes base shipped with spotlight."""
    height: int = 32
    """Image height in pixels."""
    width: int = 32
    """Image width in pixels."""
    max_text_tokens: int = 10
    """Prompt tokens after the template (fixed padding; the shapes grammar's longest prompt has 10); 0 pads to the
    longest prompt of each batch."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype of the transformer and prompt encoder."""
    device: str = "cpu"
    """Torch device, e.g. cpu or cuda."""
    lora_rank: int = 0
    """LoRA rank on attention and MLP projections; 0 trains all transformer weights."""
    lora_alpha: float = 0.0
    """LoRA alpha; 0 means equal to the rank."""
    gradient_checkpointing: bool = False
    """Recompute transformer activations in the backward pass (saves memory, costs time)."""


@dataclass
class SampleConfig:
    """Rollout and evaluation sampling."""

    num_steps: int = 10
    """Denoising steps of training rollouts."""
    eval_num_steps: int = 10
    """Denoising steps for evaluation and `spotlight sample`."""
    sde_type: Literal["flow_grpo", "cps"] = "flow_grpo"
    """Stochastic step: "flow_grpo" (Flow-GRPO's SDE) or "cps" (coefficient-preserving; noise_level is then eta in [0,
    1])."""
    noise_level: float = 0.0
    """SDE noise scale a (Flow-GRPO: 0.7 SD3.5, 0.9 FLUX, 1.2 Qwen-Image); 0 samples with the ODE (objective "nft"); for
    "cps", eta."""
    sde_window_size: int = 0
    """Number of consecutive stochastic (trained) steps; 0 makes every step stochastic."""
    sde_window_range: tuple[int, int] = (0, 5)
    """Range [lo, hi] of the window's first step, drawn per iteration (MixGRPO-style sliding window)."""
    guidance_scale: float = 1.0
    """Qwen-Image true CFG scale; 1 disables CFG (what Flow-GRPO recommends for training)."""
    negative_prompt: str = " "
    """Negative prompt for true CFG."""
    eval_noise_level: float = 0.0
    """Noise level for evaluation sampling; 0 is the deterministic ODE sampler."""
    batch_size: int = 128
    """Samples per forward batch in training rollouts (results do not depend on it; size it to memory)."""
    autocast: Literal["auto", "none", "bfloat16", "float16"] = "auto"
    """Compute dtype of the sampling forwards (rollouts, evaluation, exploration) under torch.autocast; the update's:
    train.autocast. auto: bfloat16 with objective nft on a CUDA GPU with bfloat16 or a CPU with AMX or AVX512-BF16, else
    none."""

    def validate(self) -> None:
        if self.sde_type == "cps":
            if not 0 < self.noise_level <= 1:
                raise ValueError(
                    f"with sde_type 'cps', noise_level is eta and must be in (0, 1], got {self.noise_level}"
                )
            # The last step lands on sigma = 0, where a CPS step has no noise to add.
            last_start = self.sde_window_range[1] + self.sde_window_size
            if self.sde_window_size == 0 or last_start > self.num_steps - 1:
                raise ValueError(
                    "with sde_type 'cps' the SDE window must leave the last step deterministic: "
                    "need sde_window_size > 0 and sde_window_range[1] + sde_window_size <= num_steps - 1 = "
                    f"{self.num_steps - 1}"
                )
        if self.sde_window_size > self.num_steps:
            raise ValueError(f"sde_window_size={self.sde_window_size} exceeds num_steps={self.num_steps}")
        lo, hi = self.sde_window_range
        if self.sde_window_size and not 0 <= lo <= hi <= self.num_steps - self.sde_window_size:
            raise ValueError(
                f"sde_window_range={list(self.sde_window_range)} must satisfy 0 <= lo <= hi <= "
                f"num_steps - sde_window_size = {self.num_steps - self.sde_window_size}"
            )


@dataclass
class RewardConfig:
    """Reward functions and their weights."""

    weights: dict[str, float] = field(default_factory=lambda: {"shapes": 1.0})
    """Reward name -> weight; the total is the weighted sum (see `spotlight.rewards`)."""
    clip_model_path: str = ""
    """Local CLIPModel folder for the `clip_score` and `pickscore` rewards (e.g. yuvalkirstain/PickScore_v1)."""
    clip_processor_path: str = ""
    """Local folder of the CLIP tokenizer and image processor; empty = clip_model_path (PickScore:
    laion/CLIP-ViT-H-14-laion2B-s32B-b79K)."""
    pickscore_normalize: bool = False
    """`pickscore`: map logit_scale * cosine to [0, 1] by s -> (s / logit_scale + 1) / 2;
    false keeps PickScore's scale."""
    ocr_model_path: str = ""
    """Local OCR reader folder (model + processor) for the `ocr` reward: TrOCR-style VisionEncoderDecoder or an
    image-text-to-text OCR model (e.g. stepfun-ai/GOT-OCR-2.0-hf)."""
    ocr_max_new_tokens: int = 64
    """`ocr`: most tokens the reader generates per image."""
    detector_model_path: str = ""
    """Local object-detector folder (model + image processor) for the `geneval` reward
    (e.g. facebook/detr-resnet-50)."""
    detector_threshold: float = 0.3
    """`geneval`: least detection score that counts (GenEval: 0.3)."""
    detector_count_threshold: float = 0.9
    """`geneval`: least detection score that counts for clauses with an exact count (GenEval: 0.9)."""
    batch_size: int = 16
    """Images per forward of a model-based reward (clip_score, pickscore, ocr, geneval)."""

    def options(self) -> dict:
        """Every field but the weights: the options `rewards.build_reward` routes to each reward."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "weights"}


@dataclass
class DataConfig:
    """Prompts."""

    train_prompts: str = ""
    """Prompt file (one per line) for training; empty = the shapes grammar minus the held-out split."""
    eval_prompts: str = ""
    """Prompt file for evaluation; empty = the held-out split of the shapes grammar."""
    num_heldout: int = 64
    """Size of the held-out split when prompts come from the shapes grammar."""
    split_seed: int = 0
    """Seed of the train / held-out split of the shapes grammar."""


@dataclass
class TrainConfig(TrainSettings):
    """GRPO optimisation (the shared settings: `spotlight.core.config.TrainSettings`)."""

    num_iterations: int = 1000
    """Rollout + update iterations, at most. The tiny recipe's cap is one no 2-core host reaches within
    `max_minutes` (about 140-220 iterations there), so its time budget ends the run on any host."""
    group_size: int = 16
    lr: float = 1.5e-4
    """AdamW learning rate (tiny full fine-tune with "nft": 1.5e-4 with 20 warm-up steps and adam_beta2 0.999, chosen
    by the held-out score over three grammar splits, docs/tiny-recipe-notes.md; "flow_grpo" needs 3e-5)."""
    lr_warmup_steps: int = 20
    lr_cooldown: float = 0.15
    clip_range: float = 0.2
    """PPO ratio clip epsilon (Flow-GRPO uses 1e-4 at scale; the tiny model needs larger steps)."""
    adv_std: Literal["group", "batch"] = "batch"
    max_minutes: float = 14.25
    ema_decay: float = 0.0
    """Exponential moving average of the trainable weights, per optimizer step (0: off); checkpoints then hold it
    too and `spotlight eval`/`sample` use it (`--weights raw`: the trained ones). Rollouts always use the trained
    weights."""
    objective: Literal["flow_grpo", "nft"] = "nft"
    """Policy objective: "flow_grpo" (clipped ratio of SDE step log-probs) or "nft" (DiffusionNFT
    forward-process loss)."""
    nft_beta: float = 0.5
    """DiffusionNFT: step size beta of the implicit positive/negative policies (objective "nft"); the loss's minimum
    moves v by (2r - 1)(target - v)/beta, so a smaller beta takes larger steps (the paper uses 1.0;
    docs/tiny-recipe-notes.md has the tiny recipe's choice)."""
    nft_adv_max: float = 2.0
    """DiffusionNFT: advantages are mapped to optimality r = 0.5 + 0.5 clip(A / nft_adv_max, -1, 1) (1 clips a third of
    the samples' weights, 2 a twentieth)."""
    nft_weighting: Literal["flow", "adaptive"] = "flow"
    """DiffusionNFT: per-sample loss weighting; flow: plain flow-matching squared error; adaptive: the paper's x0-space
    error over its own mean absolute value (weighs high noise levels more)."""
    nft_num_timesteps: int = 3
    """DiffusionNFT: noise levels drawn from the rollout schedule per sample and update."""
    nft_timestep_sampling: Literal["uniform", "stratified"] = "uniform"
    """DiffusionNFT: how a group's noise levels are drawn from the schedule; uniform: independently; stratified: one
    from each of nft_num_timesteps equal parts of it (repeats only across a part boundary; less variance)."""
    autocast: Literal["auto", "none", "bfloat16"] = "auto"
    """Compute dtype of the "nft" update's forwards and backward under torch.autocast (weights, gradients and optimizer
    stay in model.dtype). auto: bfloat16 on a CUDA GPU with bfloat16, none (float32) on a CPU (benchmarks/
    autocast_rollout.py measures both)."""
    prefetch_prompts: bool = True
    """Encode the next iteration's prompts on a worker thread (a side CUDA stream on a GPU) while this iteration's
    rollout and update run; the same embeddings bit for bit, the encoder's time off the critical path
    (spotlight/prompt_cache.py; benchmarks/dit_prompt_prefix.py --prefetch measures it)."""

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"train.ema_decay must be in [0, 1) (0: no moving average), got {self.ema_decay}")
        if self.objective == "nft" and (self.nft_beta <= 0 or self.nft_adv_max <= 0 or self.nft_num_timesteps < 1):
            raise ValueError(
                "train.nft_beta and train.nft_adv_max must be > 0 and train.nft_num_timesteps >= 1, got "
                f"{self.nft_beta}, {self.nft_adv_max}, {self.nft_num_timesteps}"
            )


@dataclass
class LogConfig(LogSettings):
    """Tracking and checkpoints (the shared settings: `spotlight.core.config.LogSettings`)."""

    images_every: int = 10
    """Log an image grid every this many iterations, and at the end of the run (0: never)."""
    keep_last: int = 3
    """Checkpoints kept on disk (and in the store)."""
    store_url: str = ""
    """Also publish every checkpoint to this store (a folder or s3://bucket/prefix); a run dir without a newer
    checkpoint resumes from the store's newest. Empty: the run dir only."""
    store_lease_s: float = 120.0
    """With store_url: the run's lease in the store lasts this long without a renewal (renewed every third of it). A
    replacement trainer on another machine takes the run over once the lease expired; a draining old trainer that finds
    a newer lease stops (docs/spot.md, "One writer")."""


@dataclass
class EvalConfig:
    """Evaluation (`spotlight eval`)."""

    num_seeds: int = 16
    """Seeds per prompt."""
    seed_offset: int = 1_000_000
    """First evaluation seed (kept apart from training seeds)."""
    batch_size: int = 64
    """Samples per forward batch."""
    every: int = 0
    """During `spotlight train`, evaluate the held-out prompts every this many iterations (eval/* metrics);
    0 = never."""
    stop_at: float | None = None
    """During `spotlight train`: end the run after the first of those evaluations whose held-out mean reward is at least
    this (a target reached; a final checkpoint is written); None = never."""


@dataclass
class ExploreConfig:
    """Seed exploration: score many candidate seeds per prompt on spot explorers, train on the contrasting ones."""

    mode: Literal["none", "inline", "stale"] = "none"
    """Where seeds come from: "none" = G default seeds per prompt (plain GRPO, no Ray); "inline" = explore with the
    fresh weights before each rollout and wait (the on-critical-path baseline); "stale" = explore the next batch with
    the current weights while the trainer updates (Spotlight)."""
    planner: Literal["bandit", "uniform", "greedy", "none"] = "bandit"
    """Which prompts to explore and with how many candidates each (see `planners`)."""
    planner_family: str = "shapes_counts"
    """Bandit planner: which prompts share a prior (`planners.families`); "" one family, a preset ("shapes_counts": the
    shapes grammar's count words) or "matches:REGEX"; other planners ignore it."""
    max_candidates: int = 0
    """Most candidate seeds of one prompt (the first G are the default seeds); 0 = 4 * train.group_size."""
    selection: Literal["extremes", "random"] = "extremes"
    """The G seeds kept from a prompt's candidates: "extremes" (top ceil(G/2) and bottom floor(G/2) by stale reward) or
    "random" (the control)."""
    batch_size: int = 16
    """Candidates per explorer forward batch; an explorer checks its time limit between batches."""
    window: Literal["update", "iteration"] = "iteration"
    """Stale mode: when explorers score batch k+1 with θ_k. "update": while the trainer updates θ_k -> θ_{k+1} (the
    paper's window); "iteration": from the end of update k-1, through rollout k and update k (explorers on their own
    devices idle during the trainer's rollout otherwise). Both are staleness 1; "iteration" plans before batch k's fresh
    rewards are seen."""
    budget_fraction: float = 0.8
    """Share of the predicted window (`window`) the plan may fill (headroom for weight transfer and jitter)."""
    ema: float = 0.5
    """Weight of the newest measurement in the running means of step time and explorer throughput."""
    num_steps: int = 0
    """Denoising steps of an explorer's sample (0 = sample.num_steps): cheap exploration. The seed fixes the initial
    noise and an ODE rollout (sample.noise_level 0) is a deterministic function of it, so fewer steps approximate the
    same sample at a fraction of the cost (benchmarks/stale_ranking.py measures the rank agreement)."""
    emulated_nodes: int = 0
    """Emulate this many spot explorer nodes in the trainer's process by time-slicing, instead of a Ray cluster
    (`spotlight.emulated`): the trainer pauses while each window's jobs run here, one node's jobs after another at
    runtime.worker_threads threads, so that the explorers score the candidates k nodes would have scored in the window;
    the pause is left out of time/iteration_s and reported as time/emulated_explore_s. For learning-per-iteration
    experiments on a host without the capacity (benchmarks/time_to_target.py); 0 = real explorers on the runtime."""
    fixed_budget: int = 0
    """Candidates per window whatever the window's length (0 = the budget model's fraction x window x throughput x
    explorers). With mode inline, planner uniform and P x max_candidates this is the oracle: every prompt explored with
    fresh weights, a full pool each."""

    def validate(self) -> None:
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction}")
        if not 0 < self.ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        if self.batch_size < 1:
            raise ValueError(f"explore.batch_size must be >= 1, got {self.batch_size}")
        if self.max_candidates < 0:
            raise ValueError(f"explore.max_candidates must be >= 0, got {self.max_candidates}")
        if self.num_steps < 0:
            raise ValueError(f"explore.num_steps must be >= 0, got {self.num_steps}")
        if self.emulated_nodes < 0:
            raise ValueError(f"explore.emulated_nodes must be >= 0, got {self.emulated_nodes}")
        if self.fixed_budget < 0:
            raise ValueError(f"explore.fixed_budget must be >= 0, got {self.fixed_budget}")

    def candidates_cap(self, group_size: int) -> int:
        """The effective max_candidates for a group size G."""
        return self.max_candidates or 4 * group_size


@dataclass
class RuntimeConfig:
    """Where rollouts and exploration run: the trainer's process, or the spot runtime's workers on a Ray cluster
    (docs/spot.md)."""

    rollouts: Literal["local", "cluster"] = "local"
    """Where each iteration's rollout runs: "local" = in the trainer's process; "cluster" = as jobs on the pull queue,
    served by workers on the cluster's on-demand and spot nodes, through preemptions (exploration always runs on the
    cluster's spot workers)."""
    ray_address: str = ""
    """Ray cluster to join (e.g. "10.0.0.1:6379"); empty starts a local one on 127.0.0.1: an on-demand head and
    spot_nodes spot nodes, or the nodes of `trace`."""
    spot_nodes: int = 2
    """Spot nodes of the local cluster (1 CPU and one `spot` worker each; ignored with ray_address or trace)."""
    on_demand_workers: int = 1
    """Rollout workers on the trainer's own (on-demand) node, using the devices it leaves idle while it waits for its
    rollout (runtime.rollouts=cluster; they never explore)."""
    worker_threads: int = 1
    """torch CPU threads per worker."""
    job_size: int = 32
    """Rows (prompt, seed) per rollout job, at most sample.batch_size (the forward batch sized to the device's memory);
    0 = train.group_size (one group per job). Smaller jobs lose less to a preemption and spread over more workers;
    larger ones run faster on one-thread workers (benchmarks/spot_training.py measures the trade; docs/spot.md has
    the figures). A job gives the local rollout's bits when it has sample.batch_size rows, or where the matmuls round
    the same at both sizes (the tiny recipe: spotlight/jobs.py)."""
    commit_every: int = 4
    """A worker commits a job's state (its latent) to the queue every this many steps, and at once on a preemption
    notice."""
    lease_timeout_s: float = 10.0
    """A job whose worker sent nothing for this long resumes elsewhere from its last commit (a lost node is usually seen
    sooner, by Ray)."""
    rollout_timeout_s: float = 600.0
    """Give up (an error) when an iteration's rollout jobs are not all done after this long (no live worker)."""
    startup_timeout_s: float = 120.0
    """Wait up to this long at start-up for the workers to load the model; later ones join when ready."""
    notice_poll_s: float = 0.5
    """How often a spot worker polls its metadata endpoint for an interruption notice (AWS warns 120 s ahead)."""
    emulated_step_s: float = 0.0
    """Minimum wall time of one denoising step on a worker, the rest slept: emulates a slower device (benchmarks and
    tests); 0 = off."""
    local_cluster_cpus: int = 0
    """Local cluster only (emulation on one host): run its processes (Ray's, every spot node's workers, a trace replay)
    on the last this many of the trainer's CPUs and the trainer and its on-demand workers (which use the devices the
    trainer leaves idle) on the others, as separate machines would; 0 = all share every CPU. With train.num_threads 0
    the trainer then uses one thread per CPU it keeps."""
    imds_endpoint: str = ""
    """Instance-metadata endpoint spot workers poll for interruption notices (AWS: http://169.254.169.254); empty: none,
    except a trace replay's fake ones."""
    trace: str = ""
    """Replay this spot trace on the local cluster while training (any format of `spot.traces`): its spot nodes are
    added and killed on the trace's clock."""
    trace_nodes: int = 3
    """Peak spot nodes the trace is rescaled to."""
    trace_window_s: float = 2400.0
    """Stretch of the trace to replay, in trace seconds."""
    trace_start_s: float = -1.0
    """Start of the stretch in trace seconds; -1 = the stretch with the most preemptions."""
    trace_compress: float = 40.0
    """Trace seconds per wall-clock second."""
    trace_notice_s: float = 0.0
    """Warn each preemption this many trace seconds ahead through a fake metadata endpoint per node (AWS gives 120); 0 =
    no notice."""
    trace_loop: bool = True
    """Replay the stretch again when it ends (the run outlasts it)."""

    def validate(self) -> None:
        for name in ("worker_threads", "commit_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"runtime.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("spot_nodes", "on_demand_workers", "job_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"runtime.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lease_timeout_s", "rollout_timeout_s", "trace_window_s", "trace_compress", "notice_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"runtime.{name} must be > 0, got {getattr(self, name)}")
        if self.trace and self.ray_address:
            raise ValueError(
                "runtime.trace replays a trace on a local cluster; it cannot drive runtime.ray_address's cluster"
            )
        if self.trace and self.trace_nodes < 1:
            raise ValueError(f"runtime.trace_nodes must be >= 1, got {self.trace_nodes}")
        if self.emulated_step_s < 0:
            raise ValueError(f"runtime.emulated_step_s must be >= 0, got {self.emulated_step_s}")
        if self.local_cluster_cpus < 0:
            raise ValueError(f"runtime.local_cluster_cpus must be >= 0, got {self.local_cluster_cpus}")
        if self.local_cluster_cpus and self.ray_address:
            raise ValueError(
                "runtime.local_cluster_cpus pins a local cluster's processes; runtime.ray_address joins a cluster "
                "that is not started here"
            )
        if self.trace_notice_s < 0:
            raise ValueError(f"runtime.trace_notice_s must be >= 0, got {self.trace_notice_s}")


@dataclass
class ParallelConfig:
    """Parallelism of the runtime's rollout and exploration workers."""

    sp_degree: int = 1
    """Sequence-parallel degree: workers form groups of this many (Ulysses attention over the image tokens; it must
    divide the attention heads), which re-form from the state on the nodes after a preemption (runtime.rollouts=cluster
    and exploration)."""
    sp_backend: Literal["ours", "xfuser"] = "ours"
    """Attention core of the workers' sequence-parallel forward: "ours" (spotlight/parallel/ulysses.py, any device) or
    "xfuser" (the same processor with xDiT's USP all-to-all and SDPA kernel; CUDA only, needs the gpu extra; what xDiT
    does and does not cover for Qwen-Image: docs/architecture.md)."""

    def validate(self) -> None:
        if self.sp_degree < 1:
            raise ValueError(f"parallel.sp_degree must be >= 1, got {self.sp_degree}")

    def check_device(self, device: str) -> None:
        """Raise ValueError, naming parallel.sp_backend, when the backend cannot run on `device` (model.device)."""
        if self.sp_backend == "xfuser" and not device.startswith("cuda"):
            raise ValueError(
                f"parallel.sp_backend=xfuser runs on CUDA only (xDiT needs a CUDA build of torch), but model.device is "
                f"{device!r}: set parallel.sp_backend=ours"
            )


@dataclass
class DiTRecipe:
    """A DiT GRPO post-training recipe."""

    name: str = "tiny-shapes"
    """Recipe name (the wandb run name and the default run directory name)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    log: LogConfig = field(default_factory=LogConfig)
    """Tracking and checkpoints."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    """Seed exploration."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Where rollouts and exploration run."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Sequence parallelism of the runtime's workers."""
    cost: CostConfig = field(default_factory=CostConfig)
    """GPU cost ledger."""

    def validate(self) -> None:
        self.runtime.validate()
        self.parallel.validate()
        self.parallel.check_device(self.model.device)  # a recipe that names xfuser on CPU fails as it loads
        if self.explore.max_candidates and self.explore.max_candidates <= self.train.group_size:
            raise ValueError(
                f"explore.max_candidates={self.explore.max_candidates} must be > "
                f"train.group_size={self.train.group_size} "
                "(the first G candidates are the default seeds: with G or fewer there is nothing to choose)"
            )
        if self.explore.num_steps and self.explore.num_steps != self.sample.num_steps and self.sample.noise_level > 0:
            raise ValueError(
                f"explore.num_steps={self.explore.num_steps} differs from sample.num_steps={self.sample.num_steps}, "
                "but the "
                f"rollouts are stochastic (sample.noise_level={self.sample.noise_level}): their noise is drawn per "
                "step, so "
                "a sample with other steps is not the same trajectory; cheap exploration needs ODE rollouts "
                "(noise_level 0)"
            )
        if self.explore.emulated_nodes and self.runtime.rollouts == "cluster":
            raise ValueError(
                "explore.emulated_nodes emulates explorers in the trainer's process; with runtime.rollouts=cluster "
                "the explorers are the cluster's spot workers: set one or the other"
            )
        try:
            prompt_family(self.explore.planner_family)
        except ValueError as e:
            raise ValueError(f"explore.planner_family: {e}") from None
        if self.sample.guidance_scale < 1:
            raise ValueError(f"sample.guidance_scale must be >= 1 (1 disables CFG), got {self.sample.guidance_scale}")
        if self.train.objective == "flow_grpo" and self.sample.noise_level <= 0:
            raise ValueError(
                "train.objective 'flow_grpo' trains on the log-probs of stochastic steps, so sample.noise_level "
                f"must be > 0 (got {self.sample.noise_level}); ODE rollouts need train.objective=nft"
            )
        for name, value in (("sample.autocast", self.sample.autocast), ("train.autocast", self.train.autocast)):
            if self.train.objective == "flow_grpo" and value not in ("none", "auto"):
                raise ValueError(
                    f"{name}={value!r} needs train.objective=nft: 'flow_grpo' compares the rollout's step log-probs "
                    "with the update's, which must come from the same float32 computation"
                )


@dataclass
class TinyModelConfig:
    """Sizes of a tiny Qwen-Image model folder (see `spotlight.tiny`)."""

    image_size: int = 32
    """Image height and width in pixels."""
    codec_factor: int = 2
    """Space-to-depth factor of the pixel codec (latent = image / factor); keep 4 * 3 * factor^2
    (a token's channels) below num_heads * head_dim, or the model cannot denoise every pixel."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    head_dim: int = 32
    """Channels per head."""
    text_hidden: int = 64
    """Hidden size of the Qwen2.5-VL prompt encoder (= the transformer's joint_attention_dim)."""
    seed: int = 0
    """Initialisation seed."""


@dataclass
class PretrainConfig:
    """Rectified-flow pretraining of the tiny shapes base model (`spotlight pretrain`)."""

    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Model sizes."""
    num_steps: int = 300
    """Optimizer steps (configs/dit/tiny-pretrain.yaml, the shipped base, takes 6000; 300 give a weak base of broken
    blobs in about 80 s)."""
    batch_size: int = 64
    """Images per step."""
    lr: float = 1e-3
    """AdamW learning rate (short warm-up, cosine decay to a tenth)."""
    caption_noise: float = 0.0
    """Per clause, the probability that the drawn image has a random count and shape instead of the caption's (web-like
    captions)."""
    caption_dropout: float = 0.0
    """Probability that an image is trained with the empty prompt " " instead of its caption, so that true CFG
    (`sample.guidance_scale` > 1) has an unconditional velocity to push away from."""
    num_heldout: int = 64
    """Held-out prompts excluded from pretraining (the same split as the GRPO recipe's)."""
    split_seed: int = 0
    """Seed of the train / held-out split."""
    also_hold_out_splits: tuple[int, ...] = ()
    """Further split seeds whose held-out prompts pretraining leaves out too: a base for cross-validating a recipe over
    several `data.split_seed`s (docs/tiny-recipe-notes.md)."""
    seed: int = 0
    """Data seed."""
    max_minutes: float = 0.0
    """Stop after this much time; 0 = no limit."""
    num_threads: int = 0
    """torch CPU threads; 0 keeps torch's default."""
