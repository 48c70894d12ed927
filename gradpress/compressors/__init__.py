"""Every compressor module; importing this package registers them all."""
from gradpress.compressors import identity, sparsify  # noqa: F401
