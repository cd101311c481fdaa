"""Search Self-Play (SSP) on DeepSpeed: one LLM, two roles (proposer, solver), one search engine.

Launch (every rank runs this same program: a ZeRO-3 actor shard, an in-process vLLM
engine, its share of the games, the packed loss, checkpointing):

    # GPU cluster: one line per node in the hostfile ("node1 slots=8")
    deepspeed --hostfile hostfile train.py --model_path Qwen/Qwen2.5-7B-Instruct \
        --retriever_url http://127.0.0.1:8000 --output_dir runs/qwen7b
    # one node, N ranks
    torchrun --nproc_per_node 8 train.py ...
    # CPU, 2 ranks over gloo (what scripts/demo_cpu.sh runs)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 train.py --dtype fp32 --prompts_per_step 2 ...
    # plain python: a world of one
    python train.py --dtype fp32 ...

Simplifications against the SSP paper's veRL release, on purpose:
  * one optimizer step per game (no PPO mini-batch epochs); old log-probs are recomputed
    by the actor right after generation, so the ratio starts at 1 and clipping guards
    the single step; the rollout-vs-train gap is logged as actor/rollout_gap.
  * no critic: estimator "gae" (PPO) is refused by validate_args.
  * simulated (ZeroSearch) search is not implemented yet; self-search must cover both roles.

`python train.py --help` lists every flag, grouped. Resume after any crash with the same
command line: --resume auto (the default) picks up the latest complete checkpoint.
"""

from __future__ import annotations

import os
import sys

from utils.dist import prepare_launch_env

# Environment that must be in place before torch / vLLM / DeepSpeed are imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process, not a child
prepare_launch_env()


def main(argv: list[str] | None = None) -> None:
    from training.config import ConfigError, parse_config

    try:
        cfg = parse_config(argv, description=__doc__.split("\n")[0])
        from training.trainer import SSPTrainer

        trainer = SSPTrainer(cfg)  # validates again once the world size is known
    except ConfigError as e:
        sys.exit(f"train.py: {e}")
    trainer.run()


if __name__ == "__main__":
    main()
