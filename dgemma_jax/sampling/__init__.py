"""Sampler pieces of the DiffusionGemma entropy-bound denoiser."""

from .config import SamplerConfig
from .ops import LOGIT_LIMIT
from .ops import StepStats
from .ops import apply_temperature
from .ops import entropy_bound_accept
from .ops import init_history
from .ops import push_history
from .ops import renoise
from .ops import sample_step_stats
from .ops import sanitize_logits
from .ops import stop_decision
from .ops import temperature
from .ops import temperature_table
from .ops import tokens_per_forward
from .ops import truncate_at_eos
from .ops import uniform_tokens
