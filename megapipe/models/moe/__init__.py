"""Mixture of experts: an MLP whose tokens each go to the top-k of many experts (GShard, Switch, Mixtral).

``router.py`` scores and picks experts, ``load_balancing.py`` holds the auxiliary losses and how
their gradient joins the main loss's, ``capacity.py`` drops (or pads) tokens beyond an expert's
capacity, ``experts.py`` runs the experts on tokens permuted once, ``layer.py`` puts them together
with the shared experts, ``expert_bias.py`` moves the routing bias after a step and ``stats.py``
summarises the routing for the log line, TensorBoard and W&B.
"""

from megapipe.models.moe.expert_bias import update_expert_biases
from megapipe.models.moe.layer import MoELayer
from megapipe.models.moe.load_balancing import main_loss_gradient_scale, set_aux_loss_scale
from megapipe.models.moe.stats import moe_layer_stats, moe_stats_scalars, moe_stats_text

__all__ = ["MoELayer", "main_loss_gradient_scale", "moe_layer_stats", "moe_stats_scalars", "moe_stats_text",
           "set_aux_loss_scale", "update_expert_biases"]
