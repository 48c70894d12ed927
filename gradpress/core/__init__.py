"""The core API: packets, the compressor contract, the registry of specs, random streams, errors
and error-feedback memories. Pure tensor code: nothing here communicates.
"""
