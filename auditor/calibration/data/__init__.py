"""The calibration data: batches read from a file, a function, tensors or text (:mod:`.inputs`, :mod:`.text`), and
the hashes that key what is measured with them (:mod:`.hashing`). Imports nothing else of calibration/."""
