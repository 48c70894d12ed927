"""gradpress: compressed gradient communication for data-parallel PyTorch training.

``gradpress.make(spec)`` builds any registered compressor; see ``gradpress.compressor_names()``.
Training: ``gradpress.register(ddp_model, spec)`` (DDP hook), ``gradpress.fsdp.register(model, spec)``
(FSDP2 / HSDP), ``gradpress.Communicator(spec)`` (custom loops), ``gradpress.simulate(spec,
worker_grads)`` (many workers in one process);
``gradpress.flat_stats(state.stats())`` for a metrics logger. Errors: ``NonFiniteError`` (NaN/Inf in a
rank's gradient, raised on every rank), ``ExchangeFailed`` (an exchange after an earlier one failed).
A new compressor registers with ``@gradpress.register_compressor("name")``
(``gradpress.core.compressor.register``).
``gradpress.warm_up(spec, ...)`` (also ``gradpress.compile``) compiles a method's CPU kernels ahead of
time. Importing gradpress loads neither numba nor scipy nor any method's module: each loads when first used.
"""
from gradpress import compressors as _compressors  # noqa: F401  (declares every method, importing none)
from gradpress import fsdp
from gradpress.communicator import Communicator
from gradpress.core.compressor import Compose, Compressor, NonFiniteError, Preliminary, compressor_names, make
from gradpress.core.compressor import register as register_compressor
from gradpress.core.feedback import Feedback, feedback_names, make_feedback
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.ddp import GradpressState, ddp_comm_hook, register
from gradpress.exchange.driver import ExchangeFailed
from gradpress.exchange.pipeline import flat_stats
from gradpress.simulation import Simulator, simulate
from gradpress.warmup import warm_up

#: gradpress.compile(spec, ...), as the command (not in __all__: a builtin's name)
compile = warm_up  # noqa: A001

__all__ = [
    "Compose", "Compressor", "Context", "Feedback", "NonFiniteError", "Packet",
    "compressor_names", "feedback_names", "make", "make_feedback", "pack_bits", "register", "unpack_bits",
    "thc_table",
    "Communicator", "Preliminary", "Simulator", "ddp_comm_hook", "register_compressor", "simulate",
    "ExchangeFailed", "GradpressState", "flat_stats", "fsdp",
    "warm_up", "__version__",
]
from gradpress._version import __version__  # noqa: E402

#: names whose module loads on first access (numba's kernels, scipy's THC solver)
_LAZY = {"pack_bits": "gradpress.kernels.bits", "unpack_bits": "gradpress.kernels.bits",
         "thc_table": "gradpress.compressors.thc_table"}


def __getattr__(name: str):  # noqa: ANN202 - PEP 562
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradpress' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
