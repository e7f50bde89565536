"""The Data Efficiency library and the legacy curriculum.

Parts:

* ``curriculum_scheduler``: difficulty per step (``fixed_linear``, ``fixed_root``,
  ``fixed_discrete``, ``custom``), shared by the legacy ``curriculum_learning`` section and
  every data-sampling metric;
* ``data_sampling``: offline analysis (``DataAnalyzer``), the index file format
  (``indexed_dataset``) and the curriculum batch sampler (``DeepSpeedDataSampler``);
* ``data_routing``: random layerwise token dropping (``RandomLTDScheduler``,
  ``RandomLayerTokenDrop``, ``convert_to_random_ltd``);
* ``engine_plugin``: registers the three with the engine (``runtime/engine_features``).
"""
from . import engine_plugin  # noqa: F401  (registers the engine features)
from .curriculum_scheduler import CurriculumScheduler  # noqa: F401
