"""quasar-deploy: speculative decoding verified by a W8A8 copy of the model."""

from .demo import demo_model_path
from .errors import QuasarError

__version__ = "0.1.0"
__all__ = ["QuasarError", "__version__", "demo_model_path"]
