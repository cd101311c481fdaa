"""The RL maths: packing, per-token log-probs, the policy loss, advantages, the critic, distillation, the optimizer step."""
