"""Reinforcement learning on a trained megabase model: an asynchronous generator and trainer with
in-flight weight updates, bounded staleness and MoE routing replay (``megabase rl``)."""

from .config import RLConfig, load_rl_config
from .loss import group_advantages, mismatch, rl_loss
from .replay import replay_context, routing_flips
from .reward import MotifReward, build_reward
from .rollout import Rollout, Staleness
from .run import RLResult, rl

__all__ = ["RLConfig", "RLResult", "MotifReward", "Rollout", "Staleness", "build_reward",
           "group_advantages", "load_rl_config", "mismatch", "replay_context", "rl", "rl_loss",
           "routing_flips"]
