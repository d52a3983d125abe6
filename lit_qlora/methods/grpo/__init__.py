"""Reinforcement learning with verifiable rewards, `litqlora grpo`: the settings (`args`), reward functions as users
write them (`rewards`), rollouts on the training model (`rollout`), GRPO's objective and its loss types (`loss`), the
LightningModule (`module`) and data module (`datamodule`) that `finetune`'s run trains with, and the verb
(`command`). What it shares with `litqlora dpo` (the reference policy, token log-probabilities) is
lit_qlora.train.policy's."""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__, command="grpo", loss="advantages token_terms micro_loss", module="GRPOModule",
    rewards="load_rewards score total Reward", rollout="sample_group")
