#!/usr/bin/env bash
# The recipe that plays, in one place: the self-play game shown to play on CPU (the learning proof's rung 2,
# scripts/learning_proof_cpu.sh; each setting and what it did: bench/RESULTS.md, section learning_game_settings),
# and the CPU scale it played at. Sourced, not run:
#   scripts/demo_cpu.sh, scripts/own_data_cpu.sh        GAME + GAME_CPU + RL_CPU (+ PROTO) + EVAL_CPU
#   scripts/train_common.sh (the per-size GPU scripts)  GAME only
# scripts/learning_proof_cpu.sh spells the same defaults out itself: it is the measured experiment, and its file is
# the code its results are stamped with (bench/learning_compare.py, LADDER_MEASURES); tests/test_own_data_script.py
# holds the two equal. Every variable can be overridden from the environment, as in the learning proof.
#
# GAME, everywhere. These are train.py's own defaults too (inference/game.py GameConfig; tests/test_own_data_script.py
# holds them equal): GAME spells them out so that each can be overridden from the environment here.
#   --rag_verify policy   the RAG check: the policy itself (greedy, no search) answers each question from what a
#                         solver's searches would show (inference/rag_check.solver_view); a question it cannot answer
#                         is invalid. With a judge (the GPU scripts' JUDGE_URL) RAG_VERIFY=judge: the judge takes
#                         the verifier's place, as in SSP. Without a check (--rag_verify off) "valid" did not mean
#                         answerable, and the pool recycled questions no solver ever solved.
#   --proposer_reward 1-acc   SSP's: with the RAG check, the harder an answerable question the better
#   --format_penalty -1   an invalid question below every valid one (SSP ships 0)
#   --pool_min_solve_rate 0.01 --pool_max_solve_rate 0.99   the pool admits questions some but not all solvers answered
# GAME_CPU, set by the CPU scale (a 135M model after a short SFT, 64-token turns), not by the game:
#   --min_searches 1      SSP asks for 2; the 135M SFT proposer searched its own answer twice in 1 of 4 rollouts
#   --min_question_words 4   SSP's floor is 10; a small solver's one-hop questions are shorter ("What is the capital
#                         of Abkhazia?": 6 words), and the cold-start demos are built for 4 (scripts/sft_coldstart.sh)
#   --rag_distractors 0   with 2 other trajectories' searches shuffled in, the 135M verifier refused 5 of 8 questions a
#                         step and the game died (valid rate 0.04 against 0.20); a larger verifier reads them (default 2)
# PROTO, the CPU rollout protocol of SFT rendering (scripts/sft_coldstart.sh builds its demos for it), RL and eval:
#   3 turns (at most 2 searches), MAX_TOKENS_PER_TURN (64) new tokens a turn, 1024 tokens in all, documents cut to 160.
# RL_CPU, the demo's learning settings: the top 8 layers trained, no gradient checkpointing (the model is small),
#   vLLM's log-probs as the old log-probs, a constant LR (LR, 2e-5), PROMPTS (8) proposer prompts a step, 4 solver
#   samples each (GRPO), REINFORCE++ for the proposer (one sample a prompt). The caller adds --dtype.
# EVAL_CPU, eval.py's side of the same protocol. game_table METRICS_JSONL prints the training games per step.

RAG_VERIFY=${RAG_VERIFY:-policy}
PROPOSER_REWARD=${PROPOSER_REWARD:-1-acc}
FORMAT_PENALTY=${FORMAT_PENALTY:--1}
POOL_SOLVE=${POOL_SOLVE:-"0.01 0.99"}
read -r POOL_MIN POOL_MAX <<< "$POOL_SOLVE"
GAME=(--rag_verify "$RAG_VERIFY" --proposer_reward "$PROPOSER_REWARD" --format_penalty "$FORMAT_PENALTY"
  --pool_min_solve_rate "$POOL_MIN" --pool_max_solve_rate "$POOL_MAX")

MIN_SEARCHES=${MIN_SEARCHES:-1}
MIN_QUESTION_WORDS=${MIN_QUESTION_WORDS:-4}
RAG_DISTRACTORS=${RAG_DISTRACTORS:-0}
GAME_CPU=(--min_searches "$MIN_SEARCHES" --min_question_words "$MIN_QUESTION_WORDS" --rag_distractors "$RAG_DISTRACTORS")

MAX_TOKENS_PER_TURN=${MAX_TOKENS_PER_TURN:-64}   # the smoke tests' 16 cuts generation, not the path
PROTO=(--max_turns 3 --max_tokens_per_turn "$MAX_TOKENS_PER_TURN" --max_total_tokens 1024 --max_info_tokens 160)

PROMPTS=${PROMPTS:-8}
LR=${LR:-2e-5}
RL_CPU=(--gradient_checkpointing false --train_top_layers 8 --prompts_per_step "$PROMPTS" --proposer_n 1 --solver_n 4
  --proposer_estimator reinforce++ --solver_estimator grpo "${PROTO[@]}" --max_model_len 1024
  --micro_token_budget 4096 --kv_cache_mb 512 --old_logprobs rollout --lr "$LR" --warmup_steps 0 --lr_schedule constant)
EVAL_CPU=("${PROTO[@]}" --max_model_len 1024 --kv_cache_mb 1024 --batch_size 128)

game_table() {  # metrics.jsonl: the training games per step (valid questions, pool fills, rewards, solver acc, searches)
"$PY" - "$1" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "game/valid_rate" in m:
        rows[m["step"]] = m   # a resumed run may log a step twice: the last one stands
keys = [("game/valid_rate", "valid questions"), ("game/pool_fills", "pool fills"),
        ("proposer/reward_mean", "proposer reward"), ("solver/acc", "solver acc"),
        ("solver/searches_mean", "solver searches"), ("timing_s/step", "step s")]
print("  step | " + " | ".join(name for _, name in keys))
for s in sorted(rows):
    print(f"  {s:4d} | " + " | ".join(f"{rows[s].get(k, float('nan')):{len(name)}.2f}" for k, name in keys))
if rows:
    n = len(rows)
    print(f"  mean over {n} steps: valid questions {sum(r['game/valid_rate'] for r in rows.values()) / n:.2f}, "
          f"solver acc {sum(r.get('solver/acc', 0.0) for r in rows.values()) / n:.2f}")
EOF
}
