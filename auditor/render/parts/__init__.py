"""The parts the report formats are built from, none of them a format: the layer table and its view helpers
(:mod:`.view`), the group pages (:mod:`.pages`), the calibration and speed sections (:mod:`.calibration`,
:mod:`.speed`), the charts (:mod:`.layer_charts`), the fitting of Markdown to a size (:mod:`.md_fit`) and the escaping
of names that come from a model (:mod:`.safe`). The formats (one module each) sit in :mod:`auditor.render` above."""
