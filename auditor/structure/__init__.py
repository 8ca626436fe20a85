"""What a model is made of, read from its module tree and its traced graph: the module walk and the parameter table
(``layers.py``), the tracers (``trace.py``), op costs and the layer graph (``graph.py``), where the user's code
creates each layer (``sites.py``). Below the pipeline; imports only :mod:`auditor.kinds`, the plain results and the
core modules."""
