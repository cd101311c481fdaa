"""When the critic is built (`needs_critic`), and validate_args' refusals of the critic's flags that read another
group (the KL coefficients, the estimators); CriticArgs.check() (training/settings/settings_learn.py) holds the checks of
its own fields. Imports no torch."""

from __future__ import annotations


def needs_critic(cfg) -> bool:
    """The critic is built when some role's advantages are GAE's (the other role needs no values)."""
    return "gae" in (cfg.algorithm.proposer_estimator, cfg.algorithm.solver_estimator)


def critic_errors(cfg) -> list[str]:
    """validate_args' refusals of the critic's flags that read another group ([] when there are none)."""
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
