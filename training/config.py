"""Training configuration: flat dataclasses grouped by concern, turned into argparse flags.

Every field becomes `--<field>` with its `help` text; the groups only organise
`--help`. One `validate_args` refuses bad combinations and says *why*.
The resolved config is written next to the run's outputs (config.json).

A setting the inference side also has (the game's GameConfig, the rollout's RolloutConfig) takes its
default from that dataclass field, its one source: eval.py reads the same fields, and
tests/training/test_shared_defaults.py fails when a default is written twice and drifts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence, get_type_hints

from inference.engines import MAX_MODEL_LEN  # light: these modules import no torch, vLLM or transformers
from inference.game import RAG_VERIFIERS, GameConfig, resolve_proposer_reward
from inference.prompts import TEMPLATES
from inference.rewards import PROPOSER_REWARD_KINDS
from inference.rollout import SCHEDULES, RolloutConfig
# critic_config and launch_env hold checks validate_args joins; needs_critic stays importable from here too
from training.critic_config import critic_errors, needs_critic  # noqa: F401
from training.input_checks import model_path_errors, report_to_errors
from training.launch_env import cuda_present, demo_default_errors, node_count
from training.rounds import refill_errors  # the refill lever's own checks, beside its loop
from utils.errors import InputError

ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce++", "reinforce++_baseline", "ema", "gae")  # training/advantages.py
SEARCH_BACKENDS = ("retriever", "simulated", "self", "none")


def F(default, help: str, choices=None, aliases: tuple[str, ...] = (), **kw):  # noqa: A002 - mirrors argparse's name
    """A dataclass field that carries its --help text (and choices, and other spellings of its flag) as metadata."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if aliases:
        meta["aliases"] = tuple(aliases)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class ModelArgs:
    model_path: str = F("data/models/SmolLM2-135M-Instruct", "HF model folder (or hub id) of the policy (actor); vLLM "
                                                             "loads the same folder. The default is the CPU demo's "
                                                             "135M model (see --allow_demo_defaults)")
    dtype: str = F("bf16", "training/rollout dtype; fp32 makes vLLM and the actor agree bit-for-bit (use on CPU tests)",
                   choices=("bf16", "fp32"))
    gradient_checkpointing: bool = F(True, "recompute activations in backward: long multi-turn rows fit at ~30% more compute")
    attn_implementation: str = F("auto", "auto = flash_attention_2 on CUDA when installed, else sdpa (packed rows get a block-diagonal mask)",
                                 choices=("auto", "sdpa", "flash_attention_2", "eager"))
    template: str = F(GameConfig.template, "chat template for both roles: the tokenizer's own (auto), or a named one",
                      choices=TEMPLATES)
    train_top_layers: int = F(0, "train only the last N decoder layers and the final norm (embeddings and a tied "
                                 "lm_head stay frozen; frozen layers are never re-sent to vLLM); 0 = train every weight")


@dataclass
class RolloutArgs:
    rollout_engine: str = F("vllm", "generation engine: vllm (fast), or hf (transformers, TRL's use_vllm=False): a "
                                    "full copy of the model per rank, for machines without vLLM and for debugging",
                            choices=("vllm", "hf"))
    vllm_tp: int = F(1, "vLLM tensor-parallel size across neighbouring ranks (external_launcher); must divide the world size")
    gpu_memory_utilization: float = F(0.35, "GPU: fraction of GPU memory vLLM may use (the actor lives beside it)")
    kv_cache_mb: int = F(0, "CPU: vLLM KV-cache size in MiB; 0 = room for 4 sequences of max_model_len "
                            "(on CPU gpu_memory_utilization would be read as a fraction of RAM)")
    max_model_len: int = F(MAX_MODEL_LEN, "vLLM context length; also the hard cap on a trajectory's total tokens")
    temperature: float = F(RolloutConfig.temperature, "sampling temperature for rollouts (log-probs in training use "
                                                      "the same temperature)")
    top_p: float = F(RolloutConfig.top_p, "nucleus sampling for rollouts; keep 1.0 so rollout and train log-probs "
                                          "refer to one distribution")
    sync_bucket_mb: int = F(1024, "weight sync: MiB of gathered ZeRO-3 weights per vLLM reload call (whole decoder "
                                  "layers; 0 = one layer per call, the least memory)")
    max_turns: int = F(RolloutConfig.max_turns, "max assistant turns per trajectory (each search adds one)")
    max_tokens_per_turn: int = F(RolloutConfig.max_tokens_per_turn, "max new tokens per assistant turn")
    max_total_tokens: int = F(RolloutConfig.max_total_tokens, "max tokens of a whole trajectory, prompt and "
                                                              "<information> included")
    max_info_tokens: int = F(RolloutConfig.max_info_tokens, "token budget of one <information> block, tags included "
                                                            "(retrieved docs are cut to it; Search-R1's max_obs_length "
                                                            "is 500)")
    rollout_schedule: str = F(RolloutConfig.schedule, "trajectory: each trajectory's next turn starts as soon as its "
                                                      "search returns, searches overlap decoding; turn: one engine call "
                                                      "per turn for all, then one search call (same trajectories)",
                              choices=SCHEDULES)
    max_inflight: int = F(RolloutConfig.max_inflight, "trajectory schedule: most sequences in the engine at once "
                                                      "(0 = the engine's own limit)")


@dataclass
class SearchArgs:
    proposer_search: str = F("retriever", "search backend of the proposer", choices=SEARCH_BACKENDS)
    solver_search: str = F("retriever", "search backend of the solver", choices=SEARCH_BACKENDS)
    index: str = F("data/indexes/bm25", "in-process index folder (small corpora); ignored when --retriever_url is set. "
                                        "The default is the CPU demo's BM25 index of data/corpus (see --allow_demo_defaults)")
    retriever_url: str = F("", "URL of a retrieval server (POST /retrieve, Search-R1 API), e.g. http://127.0.0.1:8000; one per node")
    topk: int = F(RolloutConfig.topk, "documents per search call")
    sim_url: str = F("", "simulated search (ZeroSearch): OpenAI-compatible server of the simulator LLM; "
                         "empty = the policy's own in-process vLLM engine writes the documents")
    sim_model: str = F("", "simulator model name on --sim_url (default: the server's first model)")
    sim_noise_start: float = F(0.25, "simulated search: chance of a noisy document at step 0")
    sim_noise_end: float = F(0.5, "simulated search: chance of a noisy document at the last step (base-4 curriculum)")
    self_search_format_reward: bool = F(GameConfig.self_search_format_reward,
                                        "self-search (SSRL): solver reward = 0.9*EM + 0.1*format "
                                        "(think first, answer last, known tags only, none empty)")


@dataclass
class SelfPlayArgs:
    # --- modes (SSP launcher names: self_play.enable, proposer.enable, solver.enable, proposer.warm_up_steps) ---
    self_play_enable: bool = F(True, "false = Search-R1-style RL: the solver trains on --qa_data only, no proposer")
    proposer_enable: bool = F(True, "train the proposer role (SSP's proposer.enable; also --train_proposer): false = it "
                                    "still plays, posing the questions, but its trajectories carry no loss",
                              aliases=("--train_proposer",))
    solver_enable: bool = F(True, "train the solver role (SSP's solver.enable; also --train_solver): false = it still "
                                  "plays, answering the questions that score the proposer, but carries no loss",
                            aliases=("--train_solver",))
    proposer_warm_up_steps: int = F(0, "for the first N steps only the proposer trains")
    qa_data: str = F("", "fixed QA rows (question, golden_answers, data_source; JSONL/parquet, Search-R1 rows work) "
                         "for self-play off or --qa_mix_fraction")
    qa_mix_fraction: float = F(0.0, "fraction of each step's prompts given to the solver as --qa_data questions "
                                    "instead of proposer prompts (0 = pure self-play)")
    train_data: str = F("data/train/proposer.jsonl", "proposer rows: answer (str or list) + search_turns; JSONL or "
                                                     "parquet (SSP's rows work). The default is the CPU demo's pool of "
                                                     "2000 answers (scripts/prepare_data.py; see --allow_demo_defaults)")
    allow_demo_defaults: bool = F(False, "accept the CPU demo's defaults (--model_path, --index without --retriever_url, "
                                         "--train_data) on CUDA or across nodes, where they are refused at start-up "
                                         "because a real run almost always meant to pass its own; CPU on one node "
                                         "never refuses them")
    prompts_per_step: int = F(0, "B: prompts per step (proposer prompts and --qa_data questions), global across ranks: "
                                 "each data-parallel group (the --vllm_tp ranks that share one vLLM engine; world / "
                                 "vllm_tp groups) plays B / (world / vllm_tp) of them, so an explicit B must be a "
                                 "multiple of world / vllm_tp. 0 = auto: 4 per data-parallel group (4 in a world of "
                                 "one, 32 on 8 GPUs at --vllm_tp 1), resolved at start-up and written to config.json")
    proposer_n: int = F(GameConfig.proposer_samples, "G_p: proposer samples per prompt")
    solver_n: int = F(GameConfig.solver_samples, "G_s: solver samples per valid question (one group, kept on one "
                                                 "rank); SSP's n is 5")
    proposer_reward: str = F(GameConfig.proposer_reward,
                             "proposer reward over its question's solver group: 1-acc (SSP: harder is better) or "
                             "4s(1-s) (peaks at 50%, 0 for a question nobody answers). auto = 1-acc when a RAG "
                             "check (--rag_verify judge|policy) rejects unanswerable questions, else 4s(1-s): "
                             "without the check 1-acc pays most for a question that is wrong",
                             choices=("auto", *PROPOSER_REWARD_KINDS))
    format_penalty: float = F(GameConfig.invalid_penalty, "proposer reward for an invalid question; below every "
                                                          "valid reward (>= 0)")
    rag_verify: str = F(GameConfig.rag_verifier, "RAG check of each question: answered from its own docs + "
                                                 "distractors by the judge (SSP's; needs --judge llm), the policy, or "
                                                 "skipped", choices=RAG_VERIFIERS)
    rag_distractors: int = F(GameConfig.rag_distractors, "k: distractor document sets shuffled into the RAG check "
                                                         "(dropped first when the documents are over budget)")
    min_searches: int = F(GameConfig.min_searches, "questions from proposer trajectories with fewer distinct "
                                                   "searches are invalid")
    min_question_words: int = F(GameConfig.min_question_words, "questions with fewer whitespace-separated words are "
                                                               "invalid (SSP's floor: 10). A small solver's one-hop "
                                                               "reading questions are shorter (\"What is the capital of "
                                                               "Abkhazia?\": 6 words); the CPU ladder and demo pass 4")
    searches_at_least_n: bool = F(GameConfig.searches_at_least_n, "a question is valid only with at least the n distinct searches its prompt "
                                         "asked for, when n > --min_searches (the SSP paper's intent; off = "
                                         "--min_searches for every question, as SSP's code)")
    search_turns_mix: str = F("", "draw each proposer row's search count n (the prompt's 'needs n searches') from "
                                  "these weights of n = 1, 2, 3, ..., e.g. 4:3:2:1 (Dr. Zero's 1-4 hops), by --seed "
                                  "and the row's position in the data stream, so a resume draws the same n; then "
                                  "clamped into [--min_searches, --max_turns - 1] like every row's n: with "
                                  "--min_searches 2 the n = 1 weight folds into n = 2. The filter asks for "
                                  "--min_searches searches whatever n is; with --searches_at_least_n true each "
                                  "question needs its own n. Empty = off: each row keeps its own search_turns")
    use_pool: bool = F(GameConfig.pool_fill, "refill failed question slots from a pool of earlier valid questions "
                                             "(distinct ones: a slot the pool cannot fill stays empty)")
    pool_size: int = F(GameConfig.pool_size, "max questions kept in the pool, the oldest dropped first (checkpointed)")
    pool_min_solve_rate: float = F(GameConfig.pool_min_solve_rate, "a valid question joins the pool only when its "
                                                                   "solver group's solve rate is at least this; > 0 "
                                                                   "keeps never-solved questions out")
    pool_max_solve_rate: float = F(GameConfig.pool_max_solve_rate, "a valid question joins the pool only when its "
                                                                   "solver group's solve rate is at most this (SSP's "
                                                                   "reuse_success_rate_threshold; its train_ssp.sh "
                                                                   "uses 1.0: every valid question)")
    pool_clear_every: int = F(GameConfig.pool_clear_every, "every N steps the pool drops the questions the game "
                                                           "admitted, keeping --pool_init's rows (SSP's "
                                                           "pool_clear_interval); 0 = never")
    pool_init: str = F("", "QA rows (question, golden_answers) that seed the pool, so the solver trains while the "
                           "proposer cannot yet write valid questions (cold start)")
    judge: str = F("em", "answer judge: em (no server) or llm (OpenAI-compatible server at --judge_url)", choices=("em", "llm"))
    judge_url: str = F("", "judge server base URL, e.g. http://127.0.0.1:8001/v1")
    judge_model: str = F("", "model name to request from the judge server")


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
    ppo_mini_batches: int = F(1, "a COUNT, not a size: optimizer steps per pass over a step's rollouts; each rank "
                                 "splits its trajectories into this many mini-batches, whole groups kept together. "
                                 "veRL's ppo_mini_batch_size is a size (prompts per mini-batch): its count is "
                                 "--prompts_per_step / ppo_mini_batch_size, e.g. 256 / 64 -> 4, not 64")


@dataclass
class CriticArgs:
    """The PPO critic, built only when a role uses --*_estimator gae (training/critic.py)."""
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


@dataclass
class DeepSpeedArgs:
    zero_stage: int = F(3, "ZeRO stage of the actor", choices=(0, 1, 2, 3))
    offload_optimizer: bool = F(False, "keep optimizer states in CPU memory")
    offload_param: bool = F(False, "keep ZeRO-3 parameters in CPU memory")
    ref_offload: bool = F(True, "keep the frozen reference model's params in CPU memory")
    gpu_memory_gb: float = F(80.0, "memory of one GPU in GiB, for the memory plan that --dry_run prints "
                                   "(training/memory_plan.py): it warns when a phase's estimate exceeds this")
    retriever_gpu_gb: float = F(0.0, "memory plan only: GiB the retrieval server (scripts/start_retriever.sh) puts on "
                                     "each training GPU it shares, added to both phases' peaks; 0 = it runs elsewhere "
                                     "(CPU, BM25, GPUs the trainer does not use). For a flat FAISS index sharded over "
                                     "the server's --faiss-gpus list: index GiB / number of those GPUs (vectors x dim x "
                                     "4 B, 2 B with fp16; retrieval.retriever.retriever_gpu_bytes gives it per GPU), "
                                     "plus FAISS's ~1.5 GiB scratch pool on each, plus the query encoder on the GPU "
                                     "that runs it. e.g. wiki-18 e5 fp32 over 8 GPUs: 60 / 8 + 1.5 = 9")
    local_rank: int = F(-1, "this process's GPU index on its node; set by the deepspeed launcher, not by hand")


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
                               "fields that may change on resume are listed in training/run_state.py OPERATIONAL")


@dataclass
class EvalArgs:
    eval_every: int = F(0, "steps between held-out evaluations (0 = only at the end, if eval_data is set)")
    eval_data: str = F("", "comma-separated eval row files (question, golden_answers, data_source)")
    eval_limit: int = F(64, "max eval rows per file")


GROUPS = {
    "model": ModelArgs, "rollout": RolloutArgs, "search": SearchArgs, "selfplay": SelfPlayArgs,
    "algorithm": AlgoArgs, "critic": CriticArgs, "optimisation": OptimArgs, "deepspeed": DeepSpeedArgs, "logging": LogArgs,
    "checkpointing": CkptArgs, "eval": EvalArgs,
}


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    search: SearchArgs = field(default_factory=SearchArgs)
    selfplay: SelfPlayArgs = field(default_factory=SelfPlayArgs)
    algorithm: AlgoArgs = field(default_factory=AlgoArgs)
    critic: CriticArgs = field(default_factory=CriticArgs)
    optimisation: OptimArgs = field(default_factory=OptimArgs)
    deepspeed: DeepSpeedArgs = field(default_factory=DeepSpeedArgs)
    logging: LogArgs = field(default_factory=LogArgs)
    checkpointing: CkptArgs = field(default_factory=CkptArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def parse_bool(s: str) -> bool:
    v = str(s).lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {s!r}")


def _flag(f, typ) -> tuple[list[str], dict[str, Any]]:
    """The flag names and argparse keywords of one dataclass field (its one name, default, help and choices)."""
    # argparse %-formats help text: a literal "30%" made --help crash.
    kw: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "").replace("%", "%%")}
    if typ is bool:
        kw.update(type=parse_bool, metavar="BOOL")
    else:
        kw["type"] = typ
    if "choices" in f.metadata:
        kw["choices"] = f.metadata["choices"]
    names = [f"--{f.name}", *f.metadata.get("aliases", ())]
    if f.name == "local_rank":
        names.append("--local-rank")  # torch.distributed.launch / deepspeed spelling
    return names, kw


def add_field_flags(g, cls, names: Sequence[str], dests: dict[str, str] | None = None,
                    aliases: dict[str, tuple[str, ...]] | None = None, metavars: dict[str, str] | None = None) -> None:
    """Add train.py's flags for the fields `names` of group `cls` to the parser (or group) `g`: same name,
    default, help and choices, so another entry point (eval.py) declares none of them again. `dests`,
    `aliases` and `metavars` give that entry point its own attribute names, extra spellings and metavars."""
    by_name, hints = {f.name: f for f in fields(cls)}, get_type_hints(cls)
    for name in names:
        flags, kw = _flag(by_name[name], hints[name])
        if name in (metavars or {}):
            kw["metavar"] = metavars[name]
        g.add_argument(*flags, *(aliases or {}).get(name, ()), dest=(dests or {}).get(name, name), **kw)


def build_parser(description: str = "", groups: dict | None = None) -> argparse.ArgumentParser:
    """One flag per field of the given dataclass groups (default: every group of Config)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for gname, cls in (groups or GROUPS).items():
        g = p.add_argument_group(gname)
        add_field_flags(g, cls, [f.name for f in fields(cls)])
    return p


def parse_config(argv: list[str] | None = None, description: str = "") -> Config:
    ns = build_parser(description).parse_args(argv)
    cfg = Config(**{g: cls(**{f.name: getattr(ns, f.name) for f in fields(cls)}) for g, cls in GROUPS.items()})
    resolve_defaults(cfg)
    validate_args(cfg)
    return cfg


AUTO_PROMPTS_PER_GROUP = 4  # --prompts_per_step 0: prompts per data-parallel group and step


def resolve_defaults(cfg: Config, world_size: int | None = None) -> Config:
    """Turn "auto" choices into what they stand for, so config.json records what actually ran.
    --prompts_per_step 0 (auto) needs the world size; without one it stays 0."""
    sp = cfg.selfplay
    sp.proposer_reward = resolve_proposer_reward(sp.proposer_reward, sp.rag_verify)
    if sp.prompts_per_step == 0 and world_size:
        sp.prompts_per_step = AUTO_PROMPTS_PER_GROUP * max(1, world_size // max(1, cfg.rollout.vllm_tp))
    return cfg


class ConfigError(InputError):
    pass


# The CPU demo's defaults, which a run on CUDA or across nodes almost never means to train with, are
# listed in training/launch_env.py (DEMO_DEFAULTS), beside the check that refuses them.


def needs_reference(cfg: Config) -> bool:
    """The frozen reference model is built for the KL penalty, or as the self-distillation teacher."""
    a = cfg.algorithm
    return a.kl_coef > 0 or cfg.critic.kl_in_reward > 0 or (a.distill != "off" and a.distill_teacher == "reference")


def validate_args(cfg: Config, world_size: int | None = None, *, cuda: bool | None = None,
                  multi_node: bool | None = None) -> None:
    """Refuse combinations that cannot work, saying why. Called at parse time and again once
    the world size is known. `cuda` / `multi_node` (None = detect: `cuda_present`, `node_count`)
    decide whether the CPU demo's defaults are refused (`demo_default_errors`)."""
    errs = []
    m, r, s, sp, a, o = cfg.model, cfg.rollout, cfg.search, cfg.selfplay, cfg.algorithm, cfg.optimisation
    if m.train_top_layers < 0:
        errs.append(f"--train_top_layers must be >= 0 (0 = train everything), got {m.train_top_layers}")
    if sp.prompts_per_step < 0:
        errs.append(f"--prompts_per_step must be >= 1, or 0 for auto (4 per data-parallel group), got {sp.prompts_per_step}")
    if sp.solver_n < 1 or sp.proposer_n < 1:
        errs.append(f"--proposer_n and --solver_n must both be >= 1 (got {sp.proposer_n}, {sp.solver_n})")
    if a.solver_estimator in ("grpo", "grpo_no_std", "rloo", "reinforce++_baseline") and sp.solver_n < 2:
        errs.append(f"--solver_estimator {a.solver_estimator} needs a group: --solver_n must be >= 2 (got {sp.solver_n})")
    if r.temperature <= 0:  # the log-probs divide by it; and a group of greedy samples is one answer, advantage 0
        errs.append(f"--temperature must be > 0 to train (got {r.temperature:g}): the policy's log-probs divide the "
                    f"logits by it, and greedy rollouts give a group no spread to learn from")
    if a.tis_cap and r.temperature != 1.0:
        errs.append("--tis_cap compares train log-probs with vLLM's raw (temperature-1) log-probs; it needs --temperature 1.0")
    if a.old_logprobs == "rollout" and (r.temperature != 1.0 or r.top_p != 1.0):
        errs.append(f"--old_logprobs rollout uses vLLM's raw (temperature-1, full-vocabulary) log-probs; it needs "
                    f"--temperature 1 and --top_p 1 (got {r.temperature}, {r.top_p}); use --old_logprobs recompute")
    if not (0 <= s.sim_noise_start <= 1 and 0 <= s.sim_noise_end <= 1):
        errs.append(f"--sim_noise_start/--sim_noise_end are probabilities in [0, 1] (got {s.sim_noise_start}, {s.sim_noise_end})")
    if s.self_search_format_reward and s.solver_search != "self":
        errs.append("--self_search_format_reward shapes the reward of self-search: it needs --solver_search self")
    if a.proposer_estimator in ("grpo", "grpo_no_std", "rloo", "reinforce++_baseline") and sp.proposer_n < 2:
        errs.append(f"--proposer_estimator {a.proposer_estimator} with --proposer_n {sp.proposer_n}: a group of one has no "
                    f"baseline, so every proposer advantage is 0 and the proposer never learns; use reinforce++ or ema, "
                    f"or set --proposer_n >= 2")
    if a.distill != "off":
        if a.distill_coef < 0 or a.distill_coef_floor < 0 or a.distill_coef_floor > a.distill_coef:
            errs.append(f"--distill_coef {a.distill_coef} and --distill_coef_floor {a.distill_coef_floor} must satisfy "
                        f"0 <= floor <= coef")
        if a.distill_context_tokens < 1:
            errs.append(f"--distill_context_tokens must be >= 1, got {a.distill_context_tokens}")
        if a.distill == "topk" and a.distill_topk < 1:
            errs.append(f"--distill_topk must be >= 1 (the teacher's top-K tokens per position), got {a.distill_topk}")
        if not sp.solver_enable:
            errs.append(f"--distill {a.distill} trains the solver toward a teacher: it needs --solver_enable true")
        if a.distill == "contrast" and not sp.self_play_enable:
            errs.append("--distill contrast scores the solver's tokens under its question's construction path against "
                        "another question's; fixed QA rows have none: it needs --self_play_enable true")
        # +32: the block's blank lines and the chat template's room around it
        if o.micro_token_budget < r.max_total_tokens + a.distill_context_tokens + 32:
            errs.append(f"--micro_token_budget {o.micro_token_budget} cannot hold a teacher sequence (--max_total_tokens "
                        f"{r.max_total_tokens} + --distill_context_tokens {a.distill_context_tokens} + 32); raise it "
                        f"or lower --distill_context_tokens")
    errs += critic_errors(cfg)
    if not (0 <= a.clip_low < 1) or a.clip_high <= 0:
        errs.append(f"clip range must satisfy 0 <= clip_low < 1 and clip_high > 0 (got {a.clip_low}, {a.clip_high})")
    errs += report_to_errors(cfg.logging.report_to)
    if not 0.0 <= o.max_failed_share <= 1.0:
        errs.append(f"--max_failed_share must be a share in [0, 1], got {o.max_failed_share}")
    if o.failed_share_window < 1 or o.max_nonfinite_steps < 1:
        errs.append(f"--failed_share_window and --max_nonfinite_steps must be >= 1 (got {o.failed_share_window}, "
                    f"{o.max_nonfinite_steps})")
    if a.ppo_epochs < 1 or a.ppo_mini_batches < 1:
        errs.append(f"--ppo_epochs and --ppo_mini_batches must be >= 1 (got {a.ppo_epochs}, {a.ppo_mini_batches})")
    errs += refill_errors(cfg)
    if a.dual_clip and a.dual_clip <= 1:
        errs.append(f"--dual_clip must be > 1 or 0 to disable (got {a.dual_clip})")
    if r.max_total_tokens > r.max_model_len:
        errs.append(f"--max_total_tokens {r.max_total_tokens} exceeds vLLM's --max_model_len {r.max_model_len}")
    if o.micro_token_budget < r.max_total_tokens:
        errs.append(f"--micro_token_budget {o.micro_token_budget} is smaller than one trajectory can be "
                    f"(--max_total_tokens {r.max_total_tokens}); packing could not place it")
    if sp.rag_verify == "judge" and sp.judge != "llm":
        errs.append("--rag_verify judge needs --judge llm and a --judge_url")
    if sp.judge == "llm" and not sp.judge_url:
        errs.append("--judge llm needs --judge_url (an OpenAI-compatible server, e.g. scripts/start_judge.sh)")
    if "retriever" in (s.proposer_search, s.solver_search) and not s.retriever_url and not Path(s.index).exists():
        errs.append(f"--index {s.index} does not exist and no --retriever_url is set; build it with "
                    f"`bash scripts/build_index.sh` or point --retriever_url at a running server")
    errs += model_path_errors(m.model_path)
    if not (sp.proposer_enable or sp.solver_enable):
        errs.append("--proposer_enable false and --solver_enable false: no role would train")
    if not sp.self_play_enable:
        if not sp.qa_data:
            errs.append("--self_play_enable false trains the solver on fixed QA pairs: give them with --qa_data")
        if sp.proposer_enable:
            errs.append("--self_play_enable false has no proposer to train; also pass --proposer_enable false")
        if not sp.solver_enable:
            errs.append("--self_play_enable false with --solver_enable false: nothing would train")
    if sp.self_play_enable and sp.min_searches > r.max_turns - 1:
        errs.append(f"--min_searches {sp.min_searches} needs --max_turns >= {sp.min_searches + 1} (got {r.max_turns}): "
                    f"the proposer searches that many times and then needs one more turn to write the question")
    if sp.min_question_words < 0:
        errs.append(f"--min_question_words must be >= 0 (got {sp.min_question_words})")
    if sp.proposer_warm_up_steps < 0:
        errs.append(f"--proposer_warm_up_steps must be >= 0 (got {sp.proposer_warm_up_steps})")
    if sp.proposer_warm_up_steps and not sp.proposer_enable:
        errs.append("--proposer_warm_up_steps trains only the proposer at first, but --proposer_enable is false")
    if not 0.0 <= sp.qa_mix_fraction < 1.0:
        errs.append(f"--qa_mix_fraction must be in [0, 1) (got {sp.qa_mix_fraction}); for QA only use --self_play_enable false")
    if sp.qa_mix_fraction and not sp.qa_data:
        errs.append("--qa_mix_fraction needs --qa_data")
    if sp.qa_data and not Path(sp.qa_data).exists():
        errs.append(f"--qa_data {sp.qa_data} does not exist")
    if sp.pool_init and not Path(sp.pool_init).exists():
        errs.append(f"--pool_init {sp.pool_init} does not exist")
    if not 0.0 <= sp.pool_min_solve_rate <= sp.pool_max_solve_rate <= 1.0:
        errs.append(f"--pool_min_solve_rate {sp.pool_min_solve_rate} and --pool_max_solve_rate {sp.pool_max_solve_rate} "
                    f"are solve rates: they must satisfy 0 <= min <= max <= 1")
    if sp.pool_clear_every < 0 or sp.pool_size < 1:
        errs.append(f"--pool_clear_every must be >= 0 (0 = never) and --pool_size >= 1 (got {sp.pool_clear_every}, "
                    f"{sp.pool_size})")
    if sp.pool_init and not sp.use_pool:
        errs.append("--pool_init seeds the question pool, which --use_pool false switches off")
    if sp.self_play_enable and not Path(sp.train_data).exists():
        errs.append(f"--train_data {sp.train_data} does not exist (run `python scripts/prepare_data.py`)")
    if r.rollout_engine == "hf" and r.vllm_tp != 1:
        errs.append(f"--rollout_engine hf holds a whole model copy per rank; --vllm_tp {r.vllm_tp} applies to vllm only "
                    "(use --vllm_tp 1)")
    if r.vllm_tp < 1:
        errs.append(f"--vllm_tp must be >= 1, got {r.vllm_tp}")
    elif world_size is not None:
        if world_size % r.vllm_tp:
            errs.append(f"--vllm_tp {r.vllm_tp} must divide the world size {world_size}")
        elif sp.prompts_per_step % (world_size // r.vllm_tp):  # 0 (auto) always fits
            dp = world_size // r.vllm_tp
            near = [k for k in (sp.prompts_per_step // dp * dp, (sp.prompts_per_step // dp + 1) * dp) if k]
            errs.append(f"--prompts_per_step {sp.prompts_per_step} must be a multiple of the data-parallel size {dp} "
                        f"(world size {world_size} / --vllm_tp {r.vllm_tp}): each data-parallel group plays the same "
                        f"number of games so collectives line up; e.g. {' or '.join(map(str, near))}, or 0 for auto "
                        f"({AUTO_PROMPTS_PER_GROUP} per group: {AUTO_PROMPTS_PER_GROUP * dp})")
    if world_size is not None and sp.prompts_per_step > 0 and r.vllm_tp >= 1 and a.ppo_mini_batches > 1:
        per_group = max(1, sp.prompts_per_step // max(1, world_size // r.vllm_tp))
        if a.ppo_mini_batches > 2 * per_group:
            errs.append(f"--ppo_mini_batches {a.ppo_mini_batches} is a count of mini-batches per step, not a size "
                        f"(veRL's ppo_mini_batch_size): each rank plays {per_group} prompt(s) a step, so it holds at "
                        f"most {2 * per_group} groups (a proposer group and a solver group per prompt) and "
                        f"{a.ppo_mini_batches} mini-batches would leave some empty; for veRL's size S pass "
                        f"--ppo_mini_batches B / S with B = --prompts_per_step {sp.prompts_per_step}")
    errs += demo_default_errors(cfg, cuda_present() if cuda is None else cuda,
                                node_count() > 1 if multi_node is None else multi_node)
    if errs:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))
