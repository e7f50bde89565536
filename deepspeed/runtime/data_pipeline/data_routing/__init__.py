"""Random layerwise token dropping (random-LTD): the schedule (``scheduler``), the layer
wrapper (``basic_layer``) and ``convert_to_random_ltd`` (``helper``); the token gather and
scatter are in ``deepspeed.ops.random_ltd``."""
from .basic_layer import RandomLayerTokenDrop  # noqa: F401
from .helper import convert_to_random_ltd, remove_random_ltd_state_dict, save_without_random_ltd  # noqa: F401
from .scheduler import RandomLTDScheduler  # noqa: F401
