"""The settings of the learning side: the RL algorithm, self-distillation, the critic, the optimizer, DeepSpeed,
logging, checkpoints and evaluation.

Each group is a dataclass whose fields are train.py's flags (training/settings/flags.py `F`: one name, one default, one
help text) and whose `check()` returns what is wrong with its own fields ([] when nothing is), each message naming
the flag, the bad value and what to do. Checks that read two groups are training/settings/validation.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.settings.flags import F
from training.settings.input_checks import model_path_errors, report_to_errors

ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce++", "reinforce++_baseline", "ema", "gae")  # training/algorithm/advantages.py


@dataclass
class AlgoArgs:
    proposer_estimator: str = F("reinforce++", "advantage estimator of the proposer; with proposer_n=1, group-norm has no baseline",
                                choices=ESTIMATORS)
    solver_estimator: str = F("grpo", "advantage estimator of the solver", choices=ESTIMATORS)
    clip_low: float = F(0.2, "PPO clip below 1 (ratio >= 1 - clip_low)")
    clip_high: float = F(0.28, "PPO clip above 1 (clip-higher, DAPO): a larger value keeps exploration alive")
    dual_clip: float = F(0.0, "dual-clip bound c > 1 for negative advantages; 0 disables")
    kl_coef: float = F(0.0, "KL penalty to the frozen reference; 0 skips the reference model entirely")
    kl_estimator: str = F("k3", "KL estimator (k3 = low-variance KL)", choices=("k1", "k2", "k3"))
    entropy_coef: float = F(0.0, "entropy bonus coefficient: the loss subtracts this x the entropy of the sampled "
                                 "tokens, aggregated as --loss_agg (0 = no bonus)")
    loss_agg: str = F("token-mean", "loss aggregation; normalised by the global count across ranks",
                      choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    tis_cap: float = F(0.0, "truncated importance sampling cap on exp(old - rollout log-prob); 0 disables")
    old_logprobs: str = F("recompute", "the ratio's old log-probs: recompute with the actor after generation, or take "
                                       "vLLM's rollout log-probs as they are (saves one forward pass per step; needs "
                                       "--temperature 1 and --top_p 1, where vLLM's raw log-probs are the policy's)",
                          choices=("recompute", "rollout"))
    ema_decay: float = F(0.9, "decay of the per-role EMA baseline (estimator 'ema')")
    update_mode: str = F("combined", "update both roles in one optimizer step, or proposer then solver", choices=("combined", "sequential"))
    ppo_epochs: int = F(1, "passes over each step's rollouts; > 1 reuses them (generation is the costly part of a "
                           "step), and from the second optimizer step on the ratio leaves 1 so clipping acts")
    drop_flat_solver_groups: bool = F(False, "leave solver groups whose rewards are all equal (all right or all wrong) "
                                             "out of the loss (DAPO's dynamic sampling, without refilling): their group "
                                             "advantages are 0, and they only dilute the token-mean normaliser")
    min_informative_groups: int = F(0, "dynamic sampling with refill (DAPO; veRL's algorithm.filter_groups): after a "
                                       "step's first round of the game, play another on the next proposer rows (and "
                                       "--qa_data rows if the step mixes them) while the step's informative solver "
                                       "groups (rewards not all equal, not left out for a failure; each counted once "
                                       "over all ranks) are fewer than N and fewer than --max_rounds rounds were "
                                       "played. Needs --drop_flat_solver_groups true. 0 = off: one round a step")
    max_rounds: int = F(3, "with --min_informative_groups: at most this many rounds of the game a step (each costs "
                           "a round's generation); a step that hits the cap trains on what it has")
    ppo_mini_batches: int = F(1, "a COUNT, not a size: optimizer steps per pass over a step's rollouts; each rank "
                                 "splits its trajectories into this many mini-batches, whole groups kept together. "
                                 "veRL's ppo_mini_batch_size is a size (prompts per mini-batch): its count is "
                                 "--prompts_per_step / ppo_mini_batch_size, e.g. 256 / 64 -> 4, not 64")

    def check(self) -> list[str]:
        """What is wrong with the algorithm's own fields ([] when nothing is)."""
        errs = []
        if not (0 <= self.clip_low < 1) or self.clip_high <= 0:
            errs.append(f"clip range must satisfy 0 <= clip_low < 1 and clip_high > 0 (got {self.clip_low}, "
                        f"{self.clip_high})")
        if self.ppo_epochs < 1 or self.ppo_mini_batches < 1:
            errs.append(f"--ppo_epochs and --ppo_mini_batches must be >= 1 (got {self.ppo_epochs}, "
                        f"{self.ppo_mini_batches})")
        if self.dual_clip and self.dual_clip <= 1:
            errs.append(f"--dual_clip must be > 1 or 0 to disable (got {self.dual_clip})")
        return errs


@dataclass
class DistillArgs:
    """Self-distillation of the solver (issues 22 and 32; training/algorithm/self_distill.py): a teacher scores the solver's
    own tokens with privileged context. Every field keeps its flag's name (--distill, --distill_coef, ...)."""
    distill: str = F("off", "self-distillation of the solver (issue 22): 'sampled' adds beta x (log q_T - log p_S) of "
                            "each sampled token to its advantage, q_T being the same model given the proposer's "
                            "question construction path (or the answer, --distill_hint) as privileged context; "
                            "'contrast' adds beta x (log q_T - log q_T given another question's path) (issue 32); "
                            "'topk' adds beta x the reverse KL of the student from q_T over q_T's top --distill_topk "
                            "tokens at each sampled position (both renormalised there) to the loss, advantages unchanged",
                     choices=("off", "sampled", "contrast", "topk"))
    distill_topk: int = F(16, "K of --distill topk: the teacher's top-K tokens per position the KL sums over; "
                              "K = the vocabulary size gives the exact full-vocabulary reverse KL (memory: the "
                              "teacher's ids and log-probs take 12 x K bytes per solver token until the update)")
    distill_coef: float = F(0.1, "beta: weight of the per-token teacher term, at step 0 (--distill_schedule decays it)")
    distill_schedule: str = F("constant", "beta over --total_steps: constant, or a linear/cosine decay to "
                                          "--distill_coef_floor", choices=("constant", "linear", "cosine"))
    distill_coef_floor: float = F(0.0, "beta at the last step of a linear or cosine --distill_schedule")
    distill_context_tokens: int = F(512, "token budget of the teacher's privileged block (answer, searches, documents)")
    distill_teacher: str = F("policy", "the teacher: the current policy (self-distillation) or the frozen reference",
                             choices=("policy", "reference"))
    distill_hint: bool = F(False, "solver questions without a construction path (fixed QA rows, pool questions "
                                  "seeded from a file) get the golden answer alone as privileged context; off, "
                                  "they get no teacher term (counted: distill/coverage)")

    def check(self) -> list[str]:
        """What is wrong with the distillation's own fields ([] when nothing is, or when --distill is off)."""
        if self.distill == "off":
            return []
        errs = []
        if self.distill_coef < 0 or self.distill_coef_floor < 0 or self.distill_coef_floor > self.distill_coef:
            errs.append(f"--distill_coef {self.distill_coef} and --distill_coef_floor {self.distill_coef_floor} must "
                        f"satisfy 0 <= floor <= coef")
        if self.distill_context_tokens < 1:
            errs.append(f"--distill_context_tokens must be >= 1, got {self.distill_context_tokens}")
        if self.distill == "topk" and self.distill_topk < 1:
            errs.append(f"--distill_topk must be >= 1 (the teacher's top-K tokens per position), got {self.distill_topk}")
        return errs


@dataclass
class CriticArgs:
    """The PPO critic, built only when a role uses --*_estimator gae (training/algorithm/critic.py)."""
    critic_model_path: str = F("", "HF folder (or hub id) the critic starts from (a causal LM: its decoder is kept and a "
                                   "scalar value head added, veRL's AutoModelForTokenClassification with one label); "
                                   "empty = the actor's --model_path")
    critic_lr: float = F(1e-5, "the critic's peak learning rate (its own AdamW); 1e-5 is veRL's and Search-R1's "
                               "critic default, 10x their actor's")
    critic_lr_warmup_steps: int = F(0, "the critic's linear LR warm-up steps")
    critic_lr_schedule: str = F("constant", "the critic's LR after warm-up: constant, or a cosine / linear decay to 0 "
                                            "at --total_steps", choices=("constant", "cosine", "linear"))
    critic_weight_decay: float = F(0.0, "AdamW's decoupled weight decay of the critic")
    critic_max_grad_norm: float = F(1.0, "the critic's gradient clipping (its own global norm)")
    critic_train_top_layers: int = F(0, "train only the critic's last N decoder layers, its final norm and its value "
                                        "head (as --train_top_layers does for the actor); 0 = train every weight")
    critic_gradient_checkpointing: bool = F(True, "recompute the critic's activations in backward (as "
                                                  "--gradient_checkpointing for the actor)")
    critic_offload_optimizer: bool = F(False, "keep the critic's optimizer states in CPU memory (DeepSpeedCPUAdam)")
    critic_offload_param: bool = F(False, "keep the critic's ZeRO-3 parameters in CPU memory")
    value_clip: float = F(0.5, "clip of the value loss: the new value may leave the rollout's value by at most this "
                               "before its loss stops counting (PPO; veRL's cliprange_value, default 0.5); 0 = off")
    critic_warmup: int = F(0, "for the first N steps only the critic trains, the actor does not (veRL's critic_warmup)")
    gae_gamma: float = F(1.0, "GAE discount over sampled tokens; 1.0 as Search-R1 and veRL for outcome rewards")
    gae_lambda: float = F(1.0, "GAE lambda; 1.0 as Search-R1 and veRL (advantage = return - value, no bootstrapping "
                               "bias) for outcome rewards")
    kl_in_reward: float = F(0.0, "KL penalty coefficient inside the gae roles' token rewards: each sampled token's "
                                 "reward gets -coef x (log pi_old - log pi_ref) (k1, DeepSpeed-Chat's and Search-R1's "
                                 "form); an alternative to --kl_coef (KL in the loss), never both; 0 = off")
    export_critic: bool = F(False, "also write an HF export of the critic (AutoModelForTokenClassification) at each "
                                   "checkpoint, under critic_hf/; its ZeRO shards are always in the checkpoint")

    def check(self) -> list[str]:
        """What is wrong with the critic's own fields ([] when nothing is). validate_args asks only when a role uses
        --*_estimator gae: otherwise no critic is built and these fields are never read."""
        errs = []
        if not (0 <= self.gae_gamma <= 1 and 0 <= self.gae_lambda <= 1):
            errs.append(f"--gae_gamma and --gae_lambda must be in [0, 1] (got {self.gae_gamma}, {self.gae_lambda})")
        if self.value_clip < 0 or self.critic_lr < 0 or self.critic_max_grad_norm <= 0:
            errs.append(f"--value_clip and --critic_lr must be >= 0 and --critic_max_grad_norm > 0 (got "
                        f"{self.value_clip}, {self.critic_lr}, {self.critic_max_grad_norm})")
        if self.critic_warmup < 0 or self.critic_lr_warmup_steps < 0 or self.critic_train_top_layers < 0:
            errs.append(f"--critic_warmup, --critic_lr_warmup_steps and --critic_train_top_layers must be >= 0 (got "
                        f"{self.critic_warmup}, {self.critic_lr_warmup_steps}, {self.critic_train_top_layers})")
        if self.critic_model_path:
            errs += [e.replace("--model_path", "--critic_model_path") for e in model_path_errors(self.critic_model_path)]
        return errs


@dataclass
class OptimArgs:
    lr: float = F(1e-6, "peak learning rate, reached after --warmup_steps and then shaped by --lr_schedule")
    weight_decay: float = F(0.0, "AdamW's decoupled weight decay coefficient on the trained weights")
    warmup_steps: int = F(0, "linear LR warm-up steps")
    lr_schedule: str = F("constant", "learning rate after warm-up: constant at --lr, or a cosine / linear decay "
                                     "from --lr to 0 at --total_steps", choices=("constant", "cosine", "linear"))
    max_grad_norm: float = F(1.0, "gradient clipping: the global gradient norm is scaled down to at most this")
    total_steps: int = F(100, "SSP steps (games) to run")
    micro_token_budget: int = F(8192, "packing: max tokens per micro-batch row (trajectories are packed into rows "
                                      "of at most this many tokens; one forward/backward per row)")
    seed: int = F(42, "global seed; each rank derives its own")
    max_failed_share: float = F(0.5, "stop the run when more than this share of the game's groups was left out of the "
                                     "loss (failed judging or search) over the last --failed_share_window steps; 1 never stops")
    failed_share_window: int = F(5, "steps the --max_failed_share is taken over")
    max_nonfinite_steps: int = F(3, "stop the run after this many steps in a row whose loss inputs, log-probs or gradient "
                                    "norm were not finite (each such optimizer step is skipped on every rank)")

    def check(self) -> list[str]:
        """What is wrong with the optimisation's own fields ([] when nothing is)."""
        errs = []
        if not 0.0 <= self.max_failed_share <= 1.0:
            errs.append(f"--max_failed_share must be a share in [0, 1], got {self.max_failed_share}")
        if self.failed_share_window < 1 or self.max_nonfinite_steps < 1:
            errs.append(f"--failed_share_window and --max_nonfinite_steps must be >= 1 (got {self.failed_share_window}, "
                        f"{self.max_nonfinite_steps})")
        return errs


@dataclass
class DeepSpeedArgs:
    zero_stage: int = F(3, "ZeRO stage of the actor", choices=(0, 1, 2, 3))
    offload_optimizer: bool = F(False, "keep optimizer states in CPU memory")
    offload_param: bool = F(False, "keep ZeRO-3 parameters in CPU memory")
    ref_offload: bool = F(True, "keep the frozen reference model's params in CPU memory")
    gpu_memory_gb: float = F(80.0, "memory of one GPU in GiB, for the memory plan that --dry_run prints "
                                   "(training/engine/memory_plan.py): it warns when a phase's estimate exceeds this")
    retriever_gpu_gb: float = F(0.0, "memory plan only: GiB the retrieval server (scripts/start_retriever.sh) puts on "
                                     "each training GPU it shares, added to both phases' peaks; 0 = it runs elsewhere "
                                     "(CPU, BM25, GPUs the trainer does not use). For a flat FAISS index sharded over "
                                     "the server's --faiss-gpus list: index GiB / number of those GPUs (vectors x dim x "
                                     "4 B, 2 B with fp16; retrieval.retriever.retriever_gpu_bytes gives it per GPU), "
                                     "plus FAISS's ~1.5 GiB scratch pool on each, plus the query encoder on the GPU "
                                     "that runs it. e.g. wiki-18 e5 fp32 over 8 GPUs: 60 / 8 + 1.5 = 9")
    local_rank: int = F(-1, "this process's GPU index on its node; set by the deepspeed launcher, not by hand")

    def check(self) -> list[str]:
        """Nothing of this group's own is refused: every value its flags accept can run."""
        return []


@dataclass
class LogArgs:
    output_dir: str = F("runs/ssp", "run folder: config, logs, TensorBoard, samples, checkpoints")
    log_every: int = F(1, "steps between scalar logs")
    sample_every: int = F(5, "steps between text dumps of sample trajectories")
    dump_rollouts: bool = F(False, "write every trajectory of every step, both roles, as JSON lines to "
                                   "<output_dir>/rollouts/step_N.rankR.jsonl (veRL's rollout_data_dir): question, "
                                   "answer, response, reward, why it stopped, why a question was refused, the "
                                   "searches and the titles they returned; for reading what the game plays")
    tensorboard: bool = F(True, "write TensorBoard event files (false leaves tensorboard out of --report_to)")
    report_to: str = F("tensorboard", "where scalars, samples and the run config go besides metrics.jsonl: a comma "
                                      "list of tensorboard, wandb, mlflow (the HF Trainer's spelling), or none. Rank 0 "
                                      "alone talks to them; one that is down or not installed gets a warning and the "
                                      "run goes on (utils/trackers.py; pip install -r requirements-trackers.txt)")

    def check(self) -> list[str]:
        """What is wrong with the logging's own fields ([] when nothing is): a --report_to naming no tracker."""
        return report_to_errors(self.report_to)


@dataclass
class CkptArgs:
    save_every: int = F(10, "steps between checkpoints (0 = only at the end)")
    max_ckpts: int = F(2, "checkpoints of this run kept on disk: the newest N (0 = keep every one); the dry run "
                          "prints the disk one save and N of them take")
    resume: str = F("auto", "auto = the latest checkpoint in output_dir if any; none; or a checkpoint folder")
    export_hf: bool = F(True, "also write an HF safetensors export (for eval.py and vLLM) at each checkpoint")
    overwrite: bool = F(False, "start over in an --output_dir whose config.json differs in a run-defining field (or "
                               "with --resume none over its checkpoints): deletes that run's checkpoints, "
                               "metrics.jsonl, samples/ and tensorboard/. Without it such a folder is refused; "
                               "fields that may change on resume are listed in training/engine/run_state.py OPERATIONAL")

    def check(self) -> list[str]:
        """Nothing of this group's own is refused: every value its flags accept can run."""
        return []


@dataclass
class EvalArgs:
    eval_every: int = F(0, "steps between held-out evaluations (0 = only at the end, if eval_data is set)")
    eval_data: str = F("", "comma-separated eval row files (question, golden_answers, data_source)")
    eval_limit: int = F(64, "max eval rows per file")

    def check(self) -> list[str]:
        """Nothing of this group's own is refused: every value its flags accept can run."""
        return []

