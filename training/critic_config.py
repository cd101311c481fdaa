"""validate_args' refusals of the critic's flags (training.config.CriticArgs), kept out of config.py
(which holds every other group's checks) so that neither module grows past its size; imports no torch."""

from __future__ import annotations

from training.input_checks import model_path_errors


def needs_critic(cfg) -> bool:
    """The critic is built when some role's advantages are GAE's (the other role needs no values)."""
    return "gae" in (cfg.algorithm.proposer_estimator, cfg.algorithm.solver_estimator)


def critic_errors(cfg) -> list[str]:
    """validate_args' refusals of the critic's flags."""
    c, a, errs = cfg.critic, cfg.algorithm, []
    if c.kl_in_reward < 0 or a.kl_coef < 0:
        errs.append(f"--kl_in_reward and --kl_coef must be >= 0 (got {c.kl_in_reward}, {a.kl_coef})")
    if c.kl_in_reward > 0 and a.kl_coef > 0:
        errs.append(f"--kl_in_reward {c.kl_in_reward} and --kl_coef {a.kl_coef} both penalise the KL to the reference: "
                    f"once in the token rewards (through the critic's returns) and once in the loss, so it would be "
                    f"paid twice; keep one and set the other to 0")
    if not needs_critic(cfg):
        if c.kl_in_reward > 0:
            errs.append("--kl_in_reward puts the KL in GAE's token-level rewards; no role uses --*_estimator gae, "
                        "so it would do nothing: use --kl_coef (KL in the loss) instead")
        if c.critic_warmup > 0:
            errs.append(f"--critic_warmup {c.critic_warmup} trains a critic alone, but no role uses --*_estimator gae, "
                        f"so there is no critic")
        return errs
    if not (0 <= c.gae_gamma <= 1 and 0 <= c.gae_lambda <= 1):
        errs.append(f"--gae_gamma and --gae_lambda must be in [0, 1] (got {c.gae_gamma}, {c.gae_lambda})")
    if c.value_clip < 0 or c.critic_lr < 0 or c.critic_max_grad_norm <= 0:
        errs.append(f"--value_clip and --critic_lr must be >= 0 and --critic_max_grad_norm > 0 (got {c.value_clip}, "
                    f"{c.critic_lr}, {c.critic_max_grad_norm})")
    if c.critic_warmup < 0 or c.critic_lr_warmup_steps < 0 or c.critic_train_top_layers < 0:
        errs.append(f"--critic_warmup, --critic_lr_warmup_steps and --critic_train_top_layers must be >= 0 (got "
                    f"{c.critic_warmup}, {c.critic_lr_warmup_steps}, {c.critic_train_top_layers})")
    if c.critic_model_path:
        errs += [e.replace("--model_path", "--critic_model_path") for e in model_path_errors(c.critic_model_path)]
    return errs
