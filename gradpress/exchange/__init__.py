"""The exchange: protocols (rounds of collectives), the strategies that build them from a
compressor's facts, the pipeline that runs feedback, compression and strategy per step, the ranks'
agreement, the driver and the one module that calls ``torch.distributed``.
"""
