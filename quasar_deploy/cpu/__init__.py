"""The CPU kernel stack: what the CPU is (``machine``), our C kernels built with the system compiler and probed by
running them (``native``: ``int8_linear``, ``half_linear``, ``decoder_ops``), the linear kernels and the float dtype
(``linears``), the one-time timing that chooses the int8 kernel (``choice``), and the OpenMP hand-off (``threads``).

Kernels are chosen by running them, never by CPU flags: ``/proc/cpuinfo`` lists instruction sets that fault here.
"""
