"""What ``lowrank-audit factorize`` writes: the factorized model's output folder, written, checked and loaded back
(:mod:`.folder`), and the model as a program that loads with plain torch or onnxruntime (:mod:`.export`)."""
