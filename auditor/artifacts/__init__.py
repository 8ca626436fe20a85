"""What the tool writes: every output file all or nothing, destinations checked before the audit, JSON strict
(:mod:`.outputs`); and what ``lowrank-audit factorize`` writes: the factorized model's output folder, written, checked
and loaded back (:mod:`.folder`), and the model as a program that loads with plain torch or onnxruntime
(:mod:`.export`)."""
