"""quasar-deploy: speculative decoding verified by a W8A8 copy of the model.

artifact = quasar_deploy.calibrate("Qwen3-8B", output="qwen3-8b-w8a8")
fidelity = quasar_deploy.evaluate("qwen3-8b-w8a8", reference="Qwen3-8B")
"""

__version__ = "0.1.0"

from .calibration import calibrate  # noqa: E402
from .demo import demo_model_path  # noqa: E402
from .engine import load  # noqa: E402
from .errors import QuasarError  # noqa: E402
from .fidelity import evaluate  # noqa: E402

__all__ = ["QuasarError", "__version__", "calibrate", "demo_model_path", "evaluate", "load"]
