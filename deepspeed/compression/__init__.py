"""Model compression (DeepSpeed Compression): quantization-aware training, pruning, layer
reduction, with DeepSpeed's module paths.

* :mod:`.compress` - ``init_compression`` (swap in compressible layers, configure the
  techniques, initialise a layer-reduced student from its teacher) and
  ``redundancy_clean`` (bake and physically shrink);
* :mod:`.basic_layer` - the compressible layers (``LinearLayer_Compress``,
  ``Conv2dLayer_Compress``, ``Embedding_Compress``, ``BNLayer_Compress``, the
  model-parallel linears) and their masks;
* :mod:`.utils` - quantizers with straight-through gradients, the top-k binarizer, the
  bit schedule, block patterns;
* :mod:`.snip` - ``snip_momentum`` structured sparse pruning;
* :mod:`.scheduler` - ``compression_scheduler``: techniques switched on by step;
* :mod:`.helper` - module lookup by name pattern, replacement, fixing;
* :mod:`.config` / :mod:`.constants` - the ``compression_training`` section as a dict;
* :mod:`.engine_feature` - the engine hook (registered on import; the runtime does not
  import this package).
"""
from . import engine_feature  # noqa: F401  registers the engine hook
from .compress import init_compression, redundancy_clean
from .helper import convert_conv1d_to_linear
from .scheduler import compression_scheduler

__all__ = ["init_compression", "redundancy_clean", "compression_scheduler", "convert_conv1d_to_linear"]
