"""The settings of the game's side: the policy model, the rollout, the search backends and self-play.

Each group is a dataclass whose fields are train.py's flags (training/settings/flags.py `F`: one name, one default, one
help text) and whose `check()` returns what is wrong with its own fields ([] when nothing is), each message naming
the flag, the bad value and what to do. Checks that read two groups are training/settings/validation.py's.

A setting the inference side also has (the game's GameConfig, the rollout's RolloutConfig) takes its default from
that dataclass field, its one source: eval.py reads the same fields, and tests/training/test_shared_defaults.py
fails when a default is written twice and drifts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inference.engine_api import MAX_MODEL_LEN  # light: these modules import no torch, vLLM or transformers
from inference.data import PROPOSER_SEEDS
from inference.filters import SHORTCUT_FILTERS
from inference.game import RAG_VERIFIERS, GameConfig
from inference.prompts import TEMPLATES
from inference.rewards import PROPOSER_REWARD_KINDS
from inference.rollout import SCHEDULES, RolloutConfig
from training.settings.flags import F
from training.settings.input_checks import model_path_errors

SEARCH_BACKENDS = ("retriever", "simulated", "self", "none")
AUTO_PROMPTS_PER_GROUP = 4  # --prompts_per_step 0: prompts per data-parallel group and step


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

    def check(self) -> list[str]:
        """What is wrong with the model's own fields ([] when nothing is)."""
        errs = []
        if self.train_top_layers < 0:
            errs.append(f"--train_top_layers must be >= 0 (0 = train everything), got {self.train_top_layers}")
        return errs + model_path_errors(self.model_path)


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
                                                      "search returns, searches overlap decoding; turn: the same loop "
                                                      "in waves, every trajectory's turn, then the turn's searches "
                                                      "(same trajectories; a comparison)",
                              choices=SCHEDULES)
    max_inflight: int = F(RolloutConfig.max_inflight, "most sequences in the engine at once "
                                                      "(0 = the engine's own limit)")

    def check(self) -> list[str]:
        """What is wrong with the rollout's own fields ([] when nothing is)."""
        errs = []
        if self.temperature <= 0:  # the log-probs divide by it; and a group of greedy samples is one answer, advantage 0
            errs.append(f"--temperature must be > 0 to train (got {self.temperature:g}): the policy's log-probs divide "
                        f"the logits by it, and greedy rollouts give a group no spread to learn from")
        if self.max_total_tokens > self.max_model_len:
            errs.append(f"--max_total_tokens {self.max_total_tokens} exceeds vLLM's --max_model_len {self.max_model_len}")
        if self.rollout_engine == "hf" and self.vllm_tp != 1:
            errs.append(f"--rollout_engine hf holds a whole model copy per rank; --vllm_tp {self.vllm_tp} applies to "
                        "vllm only (use --vllm_tp 1)")
        if self.vllm_tp < 1:
            errs.append(f"--vllm_tp must be >= 1, got {self.vllm_tp}")
        return errs


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

    def check(self) -> list[str]:
        """What is wrong with the search backends' own fields ([] when nothing is)."""
        errs = []
        if not (0 <= self.sim_noise_start <= 1 and 0 <= self.sim_noise_end <= 1):
            errs.append(f"--sim_noise_start/--sim_noise_end are probabilities in [0, 1] (got {self.sim_noise_start}, "
                        f"{self.sim_noise_end})")
        if self.self_search_format_reward and self.solver_search != "self":
            errs.append("--self_search_format_reward shapes the reward of self-search: it needs --solver_search self")
        if "retriever" in (self.proposer_search, self.solver_search) and not self.retriever_url \
                and not Path(self.index).exists():
            errs.append(f"--index {self.index} does not exist and no --retriever_url is set; build it with "
                        f"`bash scripts/build_index.sh` or point --retriever_url at a running server")
        return errs


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
    proposer_n: int = F(GameConfig.proposer_n, "G_p: proposer samples per prompt")
    solver_n: int = F(GameConfig.solver_n, "G_s: solver samples per valid question (one group, kept on one "
                                                 "rank); SSP's n is 5")
    proposer_reward: str = F(GameConfig.proposer_reward,
                             "proposer reward over its question's solver group: 1-acc (SSP: harder is better) or "
                             "4s(1-s) (peaks at 50%, 0 for a question nobody answers). auto = 1-acc when a RAG "
                             "check (--rag_verify other than off) rejects unanswerable questions, else 4s(1-s): "
                             "without the check 1-acc pays most for a question that is wrong",
                             choices=("auto", *PROPOSER_REWARD_KINDS))
    format_penalty: float = F(GameConfig.format_penalty, "proposer reward for an invalid question; below every "
                                                          "valid reward (>= 0)")
    rag_verify: str = F(GameConfig.rag_verify, "RAG check of each question: answered from its own docs + "
                                                 "distractors by the judge (SSP's; needs --judge llm), the policy (the "
                                                 "default: the recipe shown to play on CPU), or skipped (off); retrieval: no model, one search of the question with "
                                                 "the solver's back-end and --topk must return a document holding the "
                                                 "answer (Dr. Zero's rule; needs --solver_search retriever); "
                                                 "policy+retrieval: both must pass", choices=RAG_VERIFIERS)
    shortcut_filter: str = F(GameConfig.shortcut_filter, "refuse shortcut questions with proposer reward 0 (not "
                                                         "--format_penalty): title = the question's own top-1 search "
                                                         "result is the answer's page (one search of the question, "
                                                         "shared with --rag_verify retrieval; needs --solver_search "
                                                         "retriever), queries = a proposer search query holds the "
                                                         "answer (SSP's search-terms filter), both, or off",
                             choices=SHORTCUT_FILTERS)
    proposer_seed: str = F("answers", "where proposer rows come from: answers = --train_data's rows (SSP's given "
                                      "answer); articles = a random document of --index's corpus per row, its title "
                                      "the answer (Dr. Zero), drawn by --seed and the row's position so every rank "
                                      "and a resume draw the same rows; n = --search_turns_mix or --min_searches. "
                                      "--train_data is then not read", choices=PROPOSER_SEEDS)
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
    use_pool: bool = F(GameConfig.use_pool, "refill failed question slots from a pool of earlier valid questions "
                                             "(distinct ones: a slot the pool cannot fill stays empty)")
    pool_size: int = F(GameConfig.pool_size, "max questions kept in the pool, the oldest dropped first (checkpointed)")
    pool_min_solve_rate: float = F(GameConfig.pool_min_solve_rate, "a valid question joins the pool only when its "
                                                                   "solver group's solve rate is at least this; > 0 "
                                                                   "keeps never-solved questions out (0 admits them)")
    pool_max_solve_rate: float = F(GameConfig.pool_max_solve_rate, "a valid question joins the pool only when its "
                                                                   "solver group's solve rate is at most this (SSP's "
                                                                   "reuse_success_rate_threshold; its train_ssp.sh "
                                                                   "uses 1.0: every valid question); < 1 keeps out "
                                                                   "questions every solver answered")
    pool_clear_every: int = F(GameConfig.pool_clear_every, "every N steps the pool drops the questions the game "
                                                           "admitted, keeping --pool_init's rows (SSP's "
                                                           "pool_clear_interval); 0 = never")
    pool_init: str = F("", "QA rows (question, golden_answers) that seed the pool, so the solver trains while the "
                           "proposer cannot yet write valid questions (cold start)")
    judge: str = F("em", "answer judge: em (no server) or llm (OpenAI-compatible server at --judge_url)", choices=("em", "llm"))
    judge_url: str = F("", "judge server base URL, e.g. http://127.0.0.1:8001/v1")
    judge_model: str = F("", "model name to request from the judge server")
    judge_timeout_s: float = F(30.0, "seconds one judge request may take before it counts as failed")
    judge_retries: int = F(2, "retries of a failed judge request (with backoff) before its item falls back to exact match")
    judge_cooldown_s: float = F(60.0, "after the judge is found down, seconds its requests fail at once before one probe "
                                      "asks again (an outage costs one wave of timeouts, not one per call)")

    def check(self) -> list[str]:
        """What is wrong with self-play's own fields ([] when nothing is)."""
        errs = []
        if self.prompts_per_step < 0:
            errs.append(f"--prompts_per_step must be >= 1, or 0 for auto (4 per data-parallel group), got "
                        f"{self.prompts_per_step}")
        if self.judge_timeout_s <= 0 or self.judge_retries < 0 or self.judge_cooldown_s < 0:
            errs.append(f"--judge_timeout_s must be > 0, --judge_retries >= 0 and --judge_cooldown_s >= 0 (got "
                        f"{self.judge_timeout_s}, {self.judge_retries}, {self.judge_cooldown_s})")
        if self.solver_n < 1 or self.proposer_n < 1:
            errs.append(f"--proposer_n and --solver_n must both be >= 1 (got {self.proposer_n}, {self.solver_n})")
        if self.rag_verify == "judge" and self.judge != "llm":
            errs.append("--rag_verify judge needs --judge llm and a --judge_url")
        for flag, value, allowed in (("rag_verify", self.rag_verify, RAG_VERIFIERS),
                                     ("shortcut_filter", self.shortcut_filter, SHORTCUT_FILTERS),
                                     ("proposer_seed", self.proposer_seed, PROPOSER_SEEDS)):
            if value not in allowed:
                errs.append(f"--{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.judge == "llm" and not self.judge_url:
            errs.append("--judge llm needs --judge_url (an OpenAI-compatible server, e.g. scripts/start_judge.sh)")
        errs += self.role_errors() + self.data_errors() + self.pool_errors()
        if self.min_question_words < 0:
            errs.append(f"--min_question_words must be >= 0 (got {self.min_question_words})")
        return errs

    def role_errors(self) -> list[str]:
        """Which roles train: at least one, and the solver alone (on --qa_data) when self-play is off."""
        errs = []
        if not (self.proposer_enable or self.solver_enable):
            errs.append("--proposer_enable false and --solver_enable false: no role would train")
        if not self.self_play_enable:
            if not self.qa_data:
                errs.append("--self_play_enable false trains the solver on fixed QA pairs: give them with --qa_data")
            if self.proposer_enable:
                errs.append("--self_play_enable false has no proposer to train; also pass --proposer_enable false")
            if not self.solver_enable:
                errs.append("--self_play_enable false with --solver_enable false: nothing would train")
        if self.proposer_warm_up_steps < 0:
            errs.append(f"--proposer_warm_up_steps must be >= 0 (got {self.proposer_warm_up_steps})")
        if self.proposer_warm_up_steps and not self.proposer_enable:
            errs.append("--proposer_warm_up_steps trains only the proposer at first, but --proposer_enable is false")
        return errs

    def data_errors(self) -> list[str]:
        """The proposer rows and the fixed QA rows: files that exist, a mix fraction the step can take."""
        errs = []
        if not 0.0 <= self.qa_mix_fraction < 1.0:
            errs.append(f"--qa_mix_fraction must be in [0, 1) (got {self.qa_mix_fraction}); for QA only use "
                        f"--self_play_enable false")
        if self.qa_mix_fraction and not self.qa_data:
            errs.append("--qa_mix_fraction needs --qa_data")
        if self.qa_data and not Path(self.qa_data).exists():
            errs.append(f"--qa_data {self.qa_data} does not exist")
        if self.self_play_enable and self.proposer_seed == "answers" and not Path(self.train_data).exists():
            errs.append(f"--train_data {self.train_data} does not exist (run `python scripts/prepare_data.py`)")
        return errs

    def pool_errors(self) -> list[str]:
        """The question pool: solve-rate bounds, sizes, and a seed file that exists and is used."""
        errs = []
        if self.pool_init and not Path(self.pool_init).exists():
            errs.append(f"--pool_init {self.pool_init} does not exist")
        if not 0.0 <= self.pool_min_solve_rate <= self.pool_max_solve_rate <= 1.0:
            errs.append(f"--pool_min_solve_rate {self.pool_min_solve_rate} and --pool_max_solve_rate "
                        f"{self.pool_max_solve_rate} are solve rates: they must satisfy 0 <= min <= max <= 1")
        if self.pool_clear_every < 0 or self.pool_size < 1:
            errs.append(f"--pool_clear_every must be >= 0 (0 = never) and --pool_size >= 1 (got {self.pool_clear_every}, "
                        f"{self.pool_size})")
        if self.pool_init and not self.use_pool:
            errs.append("--pool_init seeds the question pool, which --use_pool false switches off")
        return errs

