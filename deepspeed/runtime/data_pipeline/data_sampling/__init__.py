"""Curriculum learning by data sampling: offline analysis (``data_analyzer``), the index
file format (``indexed_dataset``) and the batch sampler (``data_sampler``)."""
from .data_analyzer import DataAnalyzer  # noqa: F401
from .data_sampler import DeepSpeedDataSampler  # noqa: F401
from .indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder  # noqa: F401
