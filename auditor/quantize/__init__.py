"""Weight quantization: what a layer costs at each integer format, in exact bytes.

Two submodules, imported by name so that this package itself imports nothing heavy:

- ``auditor.quantize.codes``: group-wise round-to-nearest integer codes (``QuantSpec``, ``quantize``,
  ``Quantized``), bit packing (``pack``, ``unpack``) and the exact byte count of each format.
- ``auditor.quantize.knapsack``: one format per layer, least total predicted error under a byte budget
  (``Choice``, ``choose``, ``frontier``).
"""
