"""What one forward pass over the fit rows measures: the input statistics X^T X per layer (:mod:`.stats`), read block
by block (:mod:`.stream`), and the whitened spectra and truncations built on them (:mod:`.whiten`). Reads
:mod:`..data`."""
