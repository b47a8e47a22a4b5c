"""The CPU kernel stack: what the CPU is (``machine``), our C kernels built and probed (``native``: ``int8_linear``,
``half_linear``, ``decoder_ops``), the linear kernels and float dtype (``linears``), the int8 kernel's timing
(``choice``) and the OpenMP hand-off (``threads``). Kernels are chosen by running them, never by CPU flags.
"""
