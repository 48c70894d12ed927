"""gradpress: compressed gradient communication for data-parallel PyTorch training.

``gradpress.make(spec)`` builds any registered compressor; see ``gradpress.compressor_names()``.
Training: ``gradpress.register(ddp_model, spec)`` (DDP hook), ``gradpress.fsdp.register(model, spec)``
(FSDP2 / HSDP), ``gradpress.Communicator(spec)`` (custom loops), ``gradpress.simulate(spec,
worker_grads)`` (many workers in one process);
``gradpress.flat_stats(state.stats())`` for a metrics logger. Errors: ``NonFiniteError`` (NaN/Inf in a
rank's gradient, raised on every rank), ``ExchangeFailed`` (an exchange after an earlier one failed).
A new compressor registers with ``@gradpress.register_compressor("name")``
(``gradpress.core.compressor.register``).
"""
from gradpress import compressors as _compressors  # noqa: F401  (registers every method)
from gradpress.kernels.bits import pack_bits, unpack_bits
from gradpress.core.compressor import Compose, Compressor, NonFiniteError, Preliminary, compressor_names, make
from gradpress.core.compressor import register as register_compressor
from gradpress.core.feedback import Feedback, feedback_names, make_feedback
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.compressors.thc_table import thc_table
from gradpress.communicator import Communicator
from gradpress.ddp import GradpressState, ddp_comm_hook, register
from gradpress import fsdp
from gradpress.exchange.driver import ExchangeFailed
from gradpress.exchange.pipeline import flat_stats
from gradpress.simulation import Simulator, simulate

__all__ = [
    "Compose", "Compressor", "Context", "Feedback", "NonFiniteError", "Packet",
    "compressor_names", "feedback_names", "make", "make_feedback", "pack_bits", "register", "unpack_bits",
    "thc_table",
    "Communicator", "Preliminary", "Simulator", "ddp_comm_hook", "register_compressor", "simulate",
    "ExchangeFailed", "GradpressState", "flat_stats", "fsdp",
]
from gradpress._version import __version__  # noqa: E402
