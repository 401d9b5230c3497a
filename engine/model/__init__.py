"""The model and its kernels: loading checkpoints (HF directories, GGUF), the decoder over one
flattened token batch, paged attention, packed linear layers and the C++ CPU kernels (csrc/)."""

from .loader import LoadedModel, ModelLoadError, default_model_path, load_model
from .transformer import Model

__all__ = ["LoadedModel", "Model", "ModelLoadError", "default_model_path", "load_model"]
