"""gradpress: compressed gradient communication for data-parallel PyTorch training.

``gradpress.make(spec)`` builds any registered compressor; see ``gradpress.compressor_names()``.
"""
from gradpress import compressors as _compressors  # noqa: F401  (registers every method)
from gradpress.bits import pack_bits, unpack_bits
from gradpress.compressor import Compose, Compressor, NonFiniteError, compressor_names, make, register
from gradpress.feedback import Feedback, feedback_names, make_feedback
from gradpress.packet import Packet
from gradpress.rng import Context

__all__ = [
    "Compose", "Compressor", "Context", "Feedback", "NonFiniteError", "Packet",
    "compressor_names", "feedback_names", "make", "make_feedback", "pack_bits", "register", "unpack_bits",
]
__version__ = "0.1.0"
