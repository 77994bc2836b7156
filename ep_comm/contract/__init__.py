"""The contract as code, NumPy only (the lowest layer: it imports nothing of ep_comm above ``errors``).

- ``geometry``: ``Geometry``, the fixed shape of a Buffer;
- ``checks``: the argument rules (each error names the argument, the value and the rule) and the routing verdict;
- ``agreement``: the construction check, every rank's arguments equal;
- ``choices``: the names a Buffer takes: ``BACKENDS``, ``TRANSPORTS``, the payload dtypes;
- ``layout`` and ``reduce``: the reference layout and combine math; ``fp8``: FP8 blocks and scales;
- ``symmetric``: the symmetric buffer's byte layout and its typed views; ``protocol``: the constants the kernels
  compile in; ``arrays``: ``Array`` and host copies.
"""
